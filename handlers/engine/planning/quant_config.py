"""A quantized checkpoint's ``quantization_config`` read into what the loader and the memory plan need (torch-free).

Design note (why its own reading, not transformers': its GPTQ/AWQ loaders need GPU packages, and its
compressed-tensors path decompresses to float): ``config.json`` says how each linear layer's integers were made;
``parse_checkpoint_quant`` keeps the formats this server loads straight into its integer kernels and names the
reason for any other, so nothing is guessed at load time.
  compressed-tensors  ``pack-quantized``, int weights of 4 or 8 bits, per channel or grouped, symmetric or not,
                      fp activations (W4A16 / W8A16), no act-order, no sparsity or transforms;
  gptq                4 bits, grouped or per channel, symmetric or not, ``desc_act`` false (act-order permutes a
                      layer's inputs across groups: refused by name); checkpoint_format gptq (zeros stored - 1) or
                      gptq_v2;
  awq                 4 bits, GEMM layout, with zero points.
A compressed-tensors config outside that keeps the older path (transformers decompresses it to float with that
package); a GPTQ/AWQ config outside it, and every other method, is refused by ``check_quantization``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollcore.errors import ConfigError

METHODS = ("compressed-tensors", "gptq", "awq")


class UnsupportedQuantization(ConfigError):
    """A ``quantization_config`` of a known method in a variant this server does not load; the message says which."""


@dataclass(frozen=True, slots=True)
class WeightScheme:
    """How one linear layer's weight was quantized: ``bits``, ``group`` inputs per scale (0: per output channel),
    ``symmetric`` (no zero point)."""

    bits: int
    group: int
    symmetric: bool


@dataclass(frozen=True, slots=True)
class CheckpointQuant:
    """A checkpoint's quantization as the loader reads it: its ``method``, the scheme of each group of target
    modules (compressed-tensors' ``config_groups``; GPTQ and AWQ have one for every quantized layer), the modules
    left in float (``ignore``), and GPTQ's zero-point convention (``zeros_offset``: 1 for the original format)."""

    method: str
    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]
    ignore: tuple[str, ...] = ()
    zeros_offset: int = 0

    def scheme_for(self, module_name: str) -> WeightScheme | None:
        """The scheme of the linear layer ``module_name`` (None: kept in float). compressed-tensors' matching:
        a target is the class name ``Linear``, an exact module name, or ``re:PATTERN`` matched from the start."""
        if any(_matches(module_name, pattern) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(t == "Linear" or _matches(module_name, t) for t in targets):
                return scheme
        return None

    @property
    def describe(self) -> str:
        kinds = sorted({f"{s.bits}-bit {'per channel' if not s.group else f'groups of {s.group}'}"
                        f"{'' if s.symmetric else ' with zero points'}" for _, s in self.groups})
        return f"{self.method} ({', '.join(kinds)})"


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UnsupportedQuantization(f"quantization_config {what}={value!r} is not an integer")
    return value


def parse_checkpoint_quant(config: Mapping[str, Any]) -> CheckpointQuant | None:
    """The ``quantization_config`` of ``config`` (a ``config.json`` dict) when this server loads it into its integer
    kernels; None when there is none, or when it is a compressed-tensors form left to transformers. Raises
    ``UnsupportedQuantization`` for a GPTQ/AWQ variant not loaded here (act-order, 8-bit, GEMV, ...), naming it."""
    quant = config.get("quantization_config")
    if not isinstance(quant, Mapping):
        return None
    method = str(quant.get("quant_method") or "")
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    if method == "gptq":
        return _gptq(quant)
    if method == "awq":
        return _awq(quant)
    return None


def _compressed_tensors(quant: Mapping[str, Any]) -> CheckpointQuant | None:
    groups = quant.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        return None
    if quant.get("sparsity_config") or quant.get("transform_config") or quant.get("kv_cache_scheme"):
        return None
    parsed = []
    for group in groups.values():
        if not isinstance(group, Mapping):
            return None
        fmt = group.get("format") or quant.get("format")
        weights = group.get("weights")
        if fmt != "pack-quantized" or not isinstance(weights, Mapping) or group.get("input_activations") \
                or group.get("output_activations"):
            return None  # activation quantization, float formats, dense storage: transformers' float path
        if weights.get("type", "int") != "int" or weights.get("dynamic") or weights.get("actorder") == "group":
            return None
        bits, strategy = weights.get("num_bits"), weights.get("strategy")
        if bits not in (4, 8) or strategy not in ("group", "channel"):
            return None
        size = _int(weights.get("group_size"), "group_size") if strategy == "group" else 0
        if strategy == "group" and size <= 0:
            return None
        targets = group.get("targets") or ()
        if isinstance(targets, str) or not isinstance(targets, Sequence):
            return None
        parsed.append((tuple(str(t) for t in targets), WeightScheme(bits, size, bool(weights.get("symmetric", True)))))
    ignore = quant.get("ignore") or ()
    return CheckpointQuant("compressed-tensors", tuple(parsed), tuple(str(i) for i in ignore))


def _bits_4(quant: Mapping[str, Any], method: str) -> None:
    bits = quant.get("bits", quant.get("w_bit"))
    if bits != 4:
        raise UnsupportedQuantization(f"quantization_config (quant_method {method!r}, {bits} bits): only 4-bit "
                                      f"{method.upper()} checkpoints are loaded")


def _group(quant: Mapping[str, Any]) -> int:
    size = _int(quant.get("group_size", quant.get("q_group_size", 128)), "group_size")
    return 0 if size == -1 else size


def _gptq(quant: Mapping[str, Any]) -> CheckpointQuant:
    _bits_4(quant, "gptq")
    if quant.get("desc_act"):
        raise UnsupportedQuantization("quantization_config (quant_method 'gptq', desc_act=true): act-order "
                                      "checkpoints (g_idx) are not loaded; quantize with desc_act=false")
    fmt = str(quant.get("checkpoint_format") or "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedQuantization(f"quantization_config (quant_method 'gptq', checkpoint_format {fmt!r}) is "
                                      "not loaded (gptq and gptq_v2 are)")
    ignore = tuple(str(m) for m in quant.get("modules_to_not_convert") or ())
    scheme = WeightScheme(4, _group(quant), bool(quant.get("sym", True)))
    return CheckpointQuant("gptq", ((("Linear",), scheme),), ignore, zeros_offset=1 if fmt == "gptq" else 0)


def _awq(quant: Mapping[str, Any]) -> CheckpointQuant:
    _bits_4(quant, "awq")
    version = str(quant.get("version") or quant.get("format") or "gemm").lower()
    if version != "gemm":
        raise UnsupportedQuantization(f"quantization_config (quant_method 'awq', version {version!r}): only the "
                                      "GEMM layout is loaded")
    if not quant.get("zero_point", True):
        raise UnsupportedQuantization("quantization_config (quant_method 'awq', zero_point=false) is not loaded")
    group = _group(quant)
    if group == 0:
        raise UnsupportedQuantization("quantization_config (quant_method 'awq', group_size=-1) is not loaded")
    ignore = tuple(f"re:.*{re.escape(str(m))}.*" for m in quant.get("modules_to_not_convert") or ())
    return CheckpointQuant("awq", ((("Linear",), WeightScheme(4, group, False)),), ignore)


# tensor suffixes of a quantized linear layer, by method: (integers, every tensor the layer may have)
QUANT_SUFFIXES = {
    "compressed-tensors": ("weight_packed", ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
                                             "weight_g_idx")),
    "gptq": ("qweight", ("qweight", "qzeros", "scales", "g_idx")),
    "awq": ("qweight", ("qweight", "qzeros", "scales")),
}


def served_linear_bytes(quant: CheckpointQuant, out_features: int, in_features: int, scheme: WeightScheme) -> int:
    """Bytes one quantized layer takes as the kernels hold it (``int_weights.pack``): the integers (output channels
    padded to blocks of 16) and fp32 tables: a scale, and a minimum where there is one (4 bits always)."""
    rows = -(-out_features // 16) * 16
    groups = 1 if scheme.group == 0 else in_features // scheme.group
    tables = 1 if scheme.bits == 8 and scheme.symmetric else 2
    return rows * in_features * scheme.bits // 8 + tables * rows * groups * 4


def checkpoint_served_bytes(tensors: Sequence[Any], quant: CheckpointQuant, tied_head: bool) -> tuple[int, str]:
    """The bytes a quantized checkpoint takes as served (``quant_ckpt_load``), from its safetensors headers'
    tensors (``checkpoint.TensorInfo``: name, shape, nbytes, numel, floating): each quantized layer as
    ``served_linear_bytes``, every other tensor in fp32 (floats) or as stored; a tied output projection shares the
    embedding. Returns (bytes, a line saying what was counted)."""
    marker, suffixes = QUANT_SUFFIXES[quant.method]
    by_name = {t.name: t for t in tensors}
    layers = {t.name[: -len(marker) - 1] for t in tensors if t.name.endswith(f".{marker}")}
    total = quantized = 0
    for prefix in layers:
        scheme = quant.scheme_for(prefix)
        words = by_name[f"{prefix}.{marker}"].shape
        if scheme is None or len(words) != 2:
            continue  # counted as stored below; the loader refuses it by name
        if quant.method == "compressed-tensors":
            out, cols = words[0], words[1] * 32 // scheme.bits
            scale = by_name.get(f"{prefix}.weight_scale")
            if scheme.group and scale is not None and len(scale.shape) == 2:
                cols = scale.shape[1] * scheme.group
        elif quant.method == "gptq":
            cols, out = words[0] * 8, words[1]
        else:
            cols, out = words[0], words[1] * 8
        total += served_linear_bytes(quant, out, cols, scheme)
        quantized += 1
    skipped = {f"{p}.{s}" for p in layers for s in suffixes}
    for t in tensors:
        if t.name not in skipped:
            total += t.numel * 4 if t.floating else t.nbytes
    head = "; the output projection tied to the embedding" if tied_head else ""
    return total, f"safetensors headers: {quantized} layers of {quant.describe} as integers{head}"


def checkpoint_parameter_count(tensors: Sequence[Any], quant: CheckpointQuant) -> int:
    """Parameters of a quantized checkpoint from its headers' tensors: each packed int32 word of a quantized layer
    counted as the 32 / bits weights it holds (the tables and zero points as they are)."""
    marker = QUANT_SUFFIXES[quant.method][0]
    total = 0
    for t in tensors:
        scheme = quant.scheme_for(t.name[: -len(marker) - 1]) if t.name.endswith(f".{marker}") else None
        total += t.numel * (32 // scheme.bits) if scheme is not None else t.numel
    return total
