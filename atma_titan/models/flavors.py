"""Model hyper-parameters: the `ModelArgs` record, the named flavors, and config overrides.

A flavor names a full set of hyper-parameters; every `[model]` key left at None keeps the flavor's
value, so an ablation changes one key (`--model.attention softmax`) and nothing else.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from atma_titan.utils.errors import ConfigError


def arg(doc: str, default=dataclasses.MISSING, choices: tuple | None = None, config_type: type | None = None):
    """A ModelArgs field with its one-line doc and allowed values: the `[model]` config section is generated
    from these (atma_titan.config), so every hyper-parameter is described once. `config_type` is the type
    the config takes when it differs (global_layers: a pattern string)."""
    meta = {"doc": doc, "choices": choices, "config_type": config_type, "config": True}
    return dataclasses.field(default=default, metadata=meta)


def internal(default):
    """A ModelArgs field that is not a config key (fixed by the architecture)."""
    return dataclasses.field(default=default, metadata={"config": False})


DEFAULT_GLOBAL_LAYERS = "i%4==2"  # blocks 2, 6, 10, 14 of the 16-block model (docs/model.md section 1)


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int = arg("Vocabulary size")
    d_model: int = arg("Residual width")
    n_layers: int = arg("Number of blocks")
    n_heads: int = arg("Query heads in global blocks")
    n_kv_heads: int = arg("Key/value heads, GQA")
    head_dim: int = arg("Per-head dimension")
    mlp_hidden: int = arg("MLP hidden width")
    mlp: str = arg("MLP type", "relu2", ("relu2", "swiglu"))  # relu2 = squared-ReLU GLU
    global_layers: tuple[int, ...] = arg(
        "Which blocks are global (Polar/softmax + memory): a rule 'i%4==2', a list '2,6,10,14', 'all' or '[]'",
        (),
        config_type=str,
    )
    attention: str = arg("Global attention kind", "polar", ("polar", "softmax"))
    position: str = arg("Position scheme in attention", "nope", ("nope", "rope"))
    canon: bool = arg("Canon residual convolutions on q, k, v", True)
    memory: bool = arg("Gated-delta memory branch in global blocks", True)
    polar_direction: str = arg(
        "How Polar's unit direction c enters W_o: 'rms' scales it by sqrt(head_dim), so its elements have RMS 1 like "
        "every other projection's input; 'unit' is c as the paper writes it (at toy size Polar then learns its "
        "attention path ~8x slower: docs/model.md section 3)",
        "rms",
        ("rms", "unit"),
    )
    window: int = arg("Attention window in tokens, 0 = full context", 0)
    distractor_weight: float = arg("Weight of the distractor loss, 0 = off", 0.0)
    distractor_keys: int = arg("Random keys per query for the distractor loss", 16)
    gamma_max: float = arg("Cap on memory retention gamma, multiplies the sigmoid", 1.0)
    logit_softcap: float = arg("LM-head logit soft-cap c, 0 = off", 15.0)
    memory_chunk: int = arg("Chunk length of the chunked memory form", 64)
    conv_kernel: int = internal(3)
    canon_kernel: int = internal(4)
    norm_eps: float = internal(1e-6)
    rope_theta: float = internal(10_000.0)
    attention_block: int = arg("Query/key tile of the streaming Polar reference", 128)
    attention_impl: str = arg(
        "Polar kernel: auto (Triton on CUDA, reference elsewhere), triton, reference",
        "auto",
        ("auto", "triton", "reference"),
    )
    memory_impl: str = arg(
        "Gated-delta kernel: auto (Triton on CUDA, reference elsewhere), triton, reference, or fla "
        "(flash-linear-attention, when installed)",
        "auto",
        ("auto", "triton", "reference", "fla"),
    )
    mlp_impl: str = arg(
        "MLP backward's GLU pass: auto (Triton on CUDA, PyTorch elsewhere), triton, reference",
        "auto",
        ("auto", "triton", "reference"),
    )
    conv_impl: str = arg(
        "LFM2 conv block's backward pass: auto (Triton on CUDA, PyTorch elsewhere), triton, reference",
        "auto",
        ("auto", "triton", "reference"),
    )
    loss_impl: str = arg(
        "Fused LM-head loss's cross-entropy: auto (Triton on CUDA, PyTorch elsewhere), triton, reference",
        "auto",
        ("auto", "triton", "reference"),
    )

    def is_global(self, i: int) -> bool:
        return i in self.global_layers


def config_fields() -> list[dataclasses.Field]:
    """The ModelArgs fields that are `[model]` config keys."""
    return [f for f in dataclasses.fields(ModelArgs) if f.metadata.get("config")]


def parse_layer_pattern(pattern: str, n_layers: int) -> tuple[int, ...]:
    """'i%4==2' (a rule on the block index), '2,6,10,14' (a list), 'all', or '[]' (no global block)."""
    text = pattern.replace(" ", "").strip("[]()")
    if not text:
        return ()
    if text.lower() == "all":
        return tuple(range(n_layers))
    rule = re.fullmatch(r"i%(\d+)==(\d+)", text)
    if rule:
        period, rest = int(rule.group(1)), int(rule.group(2))
        if period == 0:
            raise ConfigError(f"global_layers rule {pattern!r}: the period must be >= 1")
        return tuple(i for i in range(n_layers) if i % period == rest)
    if re.fullmatch(r"\d+(,\d+)*,?", text):
        layers = tuple(sorted({int(x) for x in text.split(",") if x}))
        bad = [i for i in layers if i >= n_layers]
        if bad:
            raise ConfigError(f"global_layers {pattern!r}: block indices {bad} do not exist (n_layers = {n_layers})")
        return layers
    raise ConfigError(
        f"global_layers {pattern!r} is not understood; allowed: a rule like 'i%4==2', a list like '2,6,10,14', "
        "'all' or '[]'"
    )


FLAVORS: dict[str, ModelArgs] = {
    # Tiny: trains on a laptop CPU in seconds. Block 2 is global (i % 4 == 2).
    "debug": ModelArgs(
        vocab_size=512,
        d_model=128,
        n_layers=4,
        n_heads=2,
        n_kv_heads=1,
        head_dim=64,
        mlp_hidden=512,
        global_layers=parse_layer_pattern(DEFAULT_GLOBAL_LAYERS, 4),
        memory_chunk=32,
        attention_block=64,
    ),
    # The paper's 370M model (docs/model.md section 1): 378,220,864 parameters. Reference-kernel tiles
    # sized for a GPU at 2K (measured fastest on the H200 under compile; memory stays O(T x tile)).
    "atma_370m": ModelArgs(
        vocab_size=50_304,
        d_model=1024,
        n_layers=16,
        n_heads=8,
        n_kv_heads=2,
        head_dim=128,
        mlp_hidden=4096,
        global_layers=parse_layer_pattern(DEFAULT_GLOBAL_LAYERS, 16),
        attention_block=2048,
        memory_chunk=256,
    ),
}


def resolve_model_args(model_cfg) -> ModelArgs:
    """The flavor named by `model_cfg.flavor` with every non-None `[model]` key applied on top."""
    if model_cfg.flavor not in FLAVORS:
        raise ConfigError(f"'model.flavor' = {model_cfg.flavor!r} is unknown; allowed: {', '.join(FLAVORS)}")
    args = FLAVORS[model_cfg.flavor]
    overrides = {
        f.name: getattr(model_cfg, f.name)
        for f in dataclasses.fields(ModelArgs)
        if hasattr(model_cfg, f.name) and getattr(model_cfg, f.name) is not None and f.name != "global_layers"
    }
    n_layers = overrides.get("n_layers", args.n_layers)
    pattern = getattr(model_cfg, "global_layers", None)
    if pattern is not None:
        overrides["global_layers"] = parse_layer_pattern(pattern, n_layers)
    elif n_layers != args.n_layers:
        overrides["global_layers"] = parse_layer_pattern(DEFAULT_GLOBAL_LAYERS, n_layers)
    # The RoPE variant carries position in the rotation and drops the Canon convolutions (docs/model.md section 3).
    if overrides.get("position") == "rope" and getattr(model_cfg, "canon", None) is None:
        overrides["canon"] = False
    args = dataclasses.replace(args, **overrides)
    check_model_args(args)
    return args


def check_model_args(a: ModelArgs) -> None:
    def need(ok: bool, key: str, value, allowed: str) -> None:
        if not ok:
            raise ConfigError(f"'model.{key}' = {value!r} is invalid; allowed: {allowed}")

    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_hidden"):
        need(getattr(a, key) >= 1, key, getattr(a, key), "an integer >= 1")
    need(a.n_heads % a.n_kv_heads == 0, "n_kv_heads", a.n_kv_heads, f"a divisor of model.n_heads ({a.n_heads})")
    for f in config_fields():
        choices = f.metadata["choices"]
        if choices:
            need(getattr(a, f.name) in choices, f.name, getattr(a, f.name), " | ".join(choices))
    need(a.window >= 0, "window", a.window, "0 (full context) or a positive number of tokens")
    need(a.distractor_weight >= 0, "distractor_weight", a.distractor_weight, ">= 0")
    need(a.distractor_keys >= 1, "distractor_keys", a.distractor_keys, "an integer >= 1")
    need(0 < a.gamma_max <= 1, "gamma_max", a.gamma_max, "a number in (0, 1]")
    need(a.logit_softcap >= 0, "logit_softcap", a.logit_softcap, ">= 0 (0 = off)")
    need(a.memory_chunk >= 1, "memory_chunk", a.memory_chunk, "an integer >= 1")
    need(a.attention_block >= 1, "attention_block", a.attention_block, "an integer >= 1")
    need(not (a.position == "rope" and a.head_dim % 2), "head_dim", a.head_dim, "an even number with RoPE")
    need(
        not (a.distractor_weight > 0 and a.attention != "polar"),
        "distractor_weight",
        a.distractor_weight,
        "0 unless model.attention = polar (the loss scores keys against the Polar null)",
    )
