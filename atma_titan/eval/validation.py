"""In-training evaluation: validation loss and a short needle check, every `eval.interval` steps.

Every rank runs the same number of forward passes (FSDP gathers parameters collectively):
validation windows are split across ranks like training batches and the losses summed over ranks;
the needle probes are the same on every rank. Probes come from the training source's own language
when it is the synthetic one (`atma_titan.eval.records`), otherwise from the text protocol
(`atma_titan.eval.needle.quick_needle`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atma_titan.data import SyntheticSource, build_tokenizer
from atma_titan.data.boundaries import document_starts
from atma_titan.data.loader import build_dataloader
from atma_titan.parallel.dims import ParallelDims, all_reduce_sum


def validation_source(cfg_data, vocab_size: int):
    """Held-out data for the validation loss, or None when the config names none."""
    if cfg_data.source == "synthetic":  # another seed is a held-out split of the same language
        eot_id = build_tokenizer(cfg_data.tokenizer).eot_id
        return SyntheticSource(vocab_size, eot_id=eot_id, seed=cfg_data.seed + 1)
    if cfg_data.source == "bin" and cfg_data.val_path:
        from atma_titan.data.shards import BinShards

        return BinShards(cfg_data.val_path, vocab_size=vocab_size)
    return None


class Validator:
    """The validation loss (`val_loss`; for a mixture, `val_loss/<source>` of each source with validation data and
    `val_loss`, their mean weighted by the stage's weights) and the needle probes."""

    def __init__(self, cfg, vocab_size: int, dims: ParallelDims, document_eot: int | None = None, mixture=None):
        """document_eot: with data.document_mask, the EOT id that begins each document: the validation loss is
        then measured with documents kept apart, as training sees them. mixture: the MixtureSpec of
        [[data.sources]], whose sources each validate on their own data."""
        self.cfg, self.dims, self.document_eot, self.mixture = cfg, dims, document_eot, mixture
        if mixture is None:
            sources = {"": validation_source(cfg.data, vocab_size)}
        else:
            from atma_titan.data.mixture_data import source_config

            sources = {
                spec.name: validation_source(source_config(cfg.data, spec), vocab_size) for spec in mixture.sources
            }
        self.sources = {name: source for name, source in sources.items() if source is not None}
        self.batches = {name: self._loader(source) for name, source in self.sources.items()}
        first = next(iter(self.sources.values()), None)
        self.probe_source = first if isinstance(first, SyntheticSource) else None
        self.tokenizer = build_tokenizer(cfg.data.tokenizer) if cfg.eval.needle_gaps else None

    def _loader(self, source):
        """The first val_batches x world micro-batches of the held-out stream, the same every time."""
        t, world_size = self.cfg.training, self.dims.dp_degree
        return build_dataloader(
            source, t.seq_len, world_size * t.micro_batch_size, t.micro_batch_size, rank=self.dims.dp_rank,
            world_size=world_size,
        )  # fmt: skip

    @torch.no_grad()
    def run(self, model: torch.nn.Module, device: torch.device, step: int = 1) -> dict[str, float]:
        was_training = model.training
        model.eval()
        try:
            out = {}
            if self.batches and self.cfg.eval.val_batches:
                out.update(self._val_losses(model, device, step))
            if self.cfg.eval.needle_gaps:
                out.update(self._needle(model, device))
            return out
        finally:
            model.train(was_training)

    def _val_losses(self, model, device, step: int) -> dict[str, float]:
        losses = {name: self._val_loss(model, device, batches) for name, batches in self.batches.items()}
        if self.mixture is None:
            return {"val_loss": losses[""]}
        stage = self.mixture.stage_at(step)
        weights = {name: w for name, w in zip(self.mixture.names, stage.weights) if name in losses and w > 0}
        out = {f"val_loss/{name}": loss for name, loss in losses.items()}
        if weights:  # the mixture's: the sources this stage trains on, by their weights
            out["val_loss"] = sum(losses[n] * w for n, w in weights.items()) / sum(weights.values())
        return out

    def _val_loss(self, model, device, batches) -> float:
        totals = torch.zeros(2, device=device, dtype=torch.float64)
        it = iter(batches)
        for _ in range(self.cfg.eval.val_batches):
            inputs, labels = (t.to(device) for t in next(it))
            doc_start = None if self.document_eot is None else document_starts(inputs, self.document_eot)
            logits = model(inputs, doc_start=doc_start)
            totals[0] += F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").double()
            totals[1] += labels.numel()
        totals = all_reduce_sum(totals, self.dims)
        return (totals[0] / totals[1]).item()

    def _needle(self, model, device) -> dict[str, float]:
        gaps, trials = [int(g) for g in self.cfg.eval.needle_gaps], self.cfg.eval.needle_trials
        if self.probe_source is None:
            from atma_titan.eval.needle import quick_needle

            return quick_needle(model, self.tokenizer, gaps=gaps, trials=trials, device=device)
        from atma_titan.eval.records import evaluate_records

        return {
            f"recall@{g}": evaluate_records(model, self.probe_source, g, trials, device=device).digit_acc for g in gaps
        }
