"""The training data of a mixture config (`[[data.sources]]`, `[[data.stages]]`): its sources opened and checked up
front, this rank's loader, the per-source accounting, and what the checkpoint keeps of them.

`MixtureData` has `TrainData`'s interface (`data.build`), so the trainer handles a single source and a mixture
alike; `open_train_data` picks one. The checkpoint's global state gets one entry, "data_mixture"
(`MixtureState`): the per-source counts (windows, tokens, documents, epochs) and the document cursor of each
streamed source, the same on every rank, so both survive a resume at any world size.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from atma_titan.data.build import (
    RANDOM_ACCESS,
    DataConfigError,
    TrainData,
    _gather_positions,
    _tokenizer,
    build_document_source,
    build_source,
    shard_manifest,
)
from atma_titan.data.mixture import MixtureSchedule, MixtureSpec, SourceSpec, parse_mixture
from atma_titan.data.mixture_batches import Streamed, build_mixture_dataloader
from atma_titan.data.tokenizer import build_tokenizer, known_eot_id
from atma_titan.parallel.dims import all_gather_objects

__all__ = ["MixtureData", "MixtureState", "SourceCounts", "open_train_data", "source_config"]

COUNTS = ("windows", "tokens", "documents")


def open_train_data(cfg_data, vocab_size: int, steps: int = 1, origin: str = "config"):
    """The training data `[data]` names: a MixtureData for [[data.sources]], else a TrainData."""
    mixture = parse_mixture(cfg_data, steps, origin)
    return TrainData(cfg_data, vocab_size) if mixture is None else MixtureData(cfg_data, vocab_size, mixture)


def source_config(cfg_data, spec: SourceSpec):
    """`[data]` as it would read for this one source alone (the run's tokenizer, workers and switches)."""
    return dataclasses.replace(
        cfg_data, source=spec.source, path=spec.path, val_path=spec.val_path, hf_config=spec.hf_config,
        hf_split=spec.hf_split, text_field=spec.text_field, seed=spec.seed, sources=[], stages=[],
    )  # fmt: skip


def check_manifest_tokenizer(cfg_data, name: str) -> None:
    """Refuse prepared shards whose manifest names another tokenizer than the run's (`data.tokenizer`)."""
    manifest = shard_manifest(cfg_data.path)
    if not manifest:
        return
    saved = manifest["tokenizer"]
    if saved["name"] != cfg_data.tokenizer:
        raise DataConfigError(
            f"source '{name}': the manifest.json beside {cfg_data.path} says its shards were made with tokenizer "
            f"{saved['name']!r} (vocab {saved['vocab_size']:,}, EOT {saved.get('eot_id')}), but data.tokenizer is "
            f"{cfg_data.tokenizer!r}: every source of a run must use the run's tokenizer"
        )


class SourceCounts:
    """Windows, tokens and documents seen per source: this rank's since the run (re)started, plus the global totals
    loaded from the checkpoint. `totals()` is collective (every rank calls it at the same step)."""

    def __init__(self, names: list[str], eot_id: int):
        self.names, self.eot_id = names, eot_id
        self.base = {key: np.zeros(len(names), dtype=np.int64) for key in COUNTS}
        self.local = {key: np.zeros(len(names), dtype=np.int64) for key in COUNTS}

    def add(self, sources, inputs) -> None:
        """Count one micro-batch (CPU tensors): its windows, their input tokens, and the documents that begin in
        them (the EOT before each document is an input token: the same rule as the document cursor's)."""
        sources = sources.numpy()
        n = len(self.names)
        starts = (inputs == self.eot_id).sum(dim=1).numpy()
        windows = np.bincount(sources, minlength=n)
        self.local["windows"] += windows
        self.local["tokens"] += windows * inputs.shape[1]
        self.local["documents"] += np.bincount(sources, weights=starts, minlength=n).astype(np.int64)

    def totals(self) -> dict[str, np.ndarray]:
        gathered = all_gather_objects({key: value.tolist() for key, value in self.local.items()})
        return {key: self.base[key] + np.sum([g[key] for g in gathered], axis=0, dtype=np.int64) for key in COUNTS}

    def load(self, totals: dict) -> None:
        for key in COUNTS:
            self.base[key] = np.asarray(totals[key], dtype=np.int64)
            self.local[key][:] = 0


class MixtureState:
    """The mixture's entry of the checkpoint's global state, as a DCP Stateful ("data_mixture"): one JSON string of
    the per-source counts and epochs and each streamed source's document cursor; the same on every rank."""

    def __init__(self, data: MixtureData):
        self.data = data

    def state_dict(self) -> dict:
        data = self.data
        totals, plans = data.counts.totals(), data.current_plans()  # both collective: once each
        state = {
            "names": data.names,
            **{key: value.tolist() for key, value in totals.items()},
            "epochs": data.epochs(totals["windows"], plans),
            "plans": {name: plan.to_json() for name, plan in plans.items()},
        }
        return {"mixture": json.dumps(state, separators=(",", ":"))}

    def load_state_dict(self, state: dict) -> None:
        from atma_titan.data.stream_plan import StreamPlan

        saved = json.loads(state["mixture"])
        data = self.data
        if saved["names"] != data.names:
            raise DataConfigError(f"the checkpoint's mixture has sources {saved['names']}, this run {data.names}")
        data.counts.load(saved)
        for name, text in saved["plans"].items():
            plan = StreamPlan.from_json(text)
            data.streamed[name].source.check_plan(plan)
            data.streamed[name].plan = plan


class MixtureData:
    """A mixture's sources, opened and checked (files, shards, tokenizers, vocabulary) before a model is built."""

    random_access = False  # the trainer's resume note: a mixture says its own (resume_note)

    def __init__(self, cfg, vocab_size: int, mixture: MixtureSpec):
        self.cfg, self.mixture = cfg, mixture
        self.names = mixture.names
        self.live_loader = None
        self.num_parts, self.seq_len = 0, 0  # set by loader()
        self.sources: list = []
        self.streamed: dict[str, Streamed] = {}
        self.configs = [source_config(cfg, spec) for spec in mixture.sources]
        tokenizer = None
        for spec, cfg_i in zip(mixture.sources, self.configs):
            if spec.source in RANDOM_ACCESS:
                if spec.source == "bin":
                    check_manifest_tokenizer(cfg_i, spec.name)
                self.sources.append(build_source(cfg_i, vocab_size))
            else:
                tokenizer = tokenizer or _tokenizer(cfg, vocab_size)
                document_source = build_document_source(cfg_i)
                streamed = Streamed(document_source, tokenizer, document_source.fresh_plan())
                self.streamed[spec.name] = streamed
                self.sources.append(streamed)
        self.counts = SourceCounts(self.names, self.eot_id)

    @property
    def eot_id(self) -> int:
        known = known_eot_id(self.cfg.tokenizer)  # one tokenizer for every source; no files needed when known
        return known if known is not None else build_tokenizer(self.cfg.tokenizer).eot_id

    def checkpoint_state(self) -> dict:
        return {"data_mixture": MixtureState(self)}

    def schedule(self, global_batch: int) -> MixtureSchedule:
        return MixtureSchedule(self.mixture, global_batch)

    def epochs(self, windows: np.ndarray, plans: dict) -> list[float]:
        """Passes over each source so far: windows over its windows per pass (`.bin`), its stream plan's pass
        (text, HF; `plans` from current_plans()), 0 for the synthetic source, which never repeats."""
        out = []
        for name, spec, source, taken in zip(self.names, self.mixture.sources, self.sources, windows):
            if spec.source == "bin":
                out.append(float(taken) / source.num_windows(self.seq_len + 1) if self.seq_len else 0.0)
            elif name in plans:
                out.append(float(min(u.epoch for u in plans[name].units)))
            else:
                out.append(0.0)
        return out

    def describe(self) -> list[str]:
        """The header's lines: the sources, then each stage's weights."""
        sources = ", ".join(
            f"{spec.name} ({spec.source}{': ' + spec.path if spec.path else ''})" for spec in self.mixture.sources
        )
        lines = [f"a mixture of {len(self.names)} sources (data.sources, seed {self.mixture.seed}): {sources}"]
        for stage in self.mixture.stages:
            shares = ", ".join(f"{name} {share:.0%}" for name, share in zip(self.names, stage.shares))
            lines.append(f"  stage {stage.name} from step {stage.start_step}: {shares}")
        return lines

    def summary(self, totals: dict[str, np.ndarray]) -> list[str]:
        """The end-of-run lines: per source, tokens (and their share), documents and passes."""
        tokens, documents = totals["tokens"], totals["documents"]
        epochs = self.epochs(totals["windows"], self.current_plans())
        lines = []
        for name, spec, n, docs, passes in zip(self.names, self.mixture.sources, tokens, documents, epochs):
            share = n / max(1, tokens.sum())
            seen = f", pass {passes:.2f}" if spec.source == "bin" else ""
            lines.append(f"{name}: {int(n):,} tokens ({share:.1%}), {int(docs):,} documents{seen}")
        return lines

    def windows_per_pass(self, seq_len: int) -> list[int | None]:
        """Each source's windows in one pass: 0 for the synthetic source (generated), None for a streamed one."""
        kinds = [spec.source for spec in self.mixture.sources]
        return [
            0 if kind == "synthetic" else source.num_windows(seq_len + 1) if kind == "bin" else None
            for kind, source in zip(kinds, self.sources)
        ]

    def plan_lines(self, global_batch: int, seq_len: int, steps: int) -> list[str]:
        from atma_titan.data.mixture import describe_plan

        return describe_plan(self.schedule(global_batch), steps, seq_len, self.windows_per_pass(seq_len))

    def current_plans(self) -> dict:
        """Each streamed source's plan advanced by what every rank's loader consumed (collective once it exists)."""
        from atma_titan.data.packing import _dataset_states

        if self.live_loader is None:
            return {name: streamed.plan for name, streamed in self.streamed.items()}
        states = _dataset_states(self.live_loader)
        plans = {}
        for name, streamed in self.streamed.items():
            local = {
                s["streams"][name]["part"]: s["streams"][name]["consumed"]
                for s in states
                if name in s.get("streams", {})
            }
            plans[name] = streamed.plan.advanced(_gather_positions(local), self.num_parts)
        return plans

    def resume_note(self) -> str:
        if not self.streamed:
            return "the mixture continues from the global window count"
        notes = [f"{name}: {streamed.plan.describe()}" for name, streamed in self.streamed.items()]
        return (
            "the mixture's windows continue from the global window count; its streamed sources from their document "
            f"cursors ({'; '.join(notes)}), the untrained rest of at most one document per old part skipped"
        )

    def loader(
        self,
        *,
        seq_len: int,
        global_batch: int,
        micro_batch: int,
        rank: int,
        world_size: int,
        start_window: int,
        pin_memory: bool,
        skips=None,
    ):
        workers = self.cfg.num_workers
        self.seq_len = seq_len
        self.num_parts = world_size * max(workers, 1)
        for streamed in self.streamed.values():
            streamed.plan = streamed.plan.split(self.num_parts)
        schedule = self.schedule(global_batch)
        saved = self.counts.base["windows"]
        # Resumed: each source continues where it stopped, even if the stages moved (with skips, the stream's counts
        # include skipped windows, which the saved counts do not: the current stages' draws decide then).
        if start_window and saved.sum() == start_window and not skips:
            schedule.anchor(start_window, saved)
        self.live_loader = build_mixture_dataloader(
            schedule,
            self.sources,
            seq_len,
            global_batch,
            micro_batch,
            names=self.names,
            rank=rank,
            world_size=world_size,
            start_window=start_window,
            num_workers=workers,
            pin_memory=pin_memory,
            skips=skips,
        )
        return self.live_loader
