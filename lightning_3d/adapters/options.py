"""The adapter options: which fine-tuning method, and LoRA's settings under ``peft``'s names.

``method`` is ``"none"`` (full fine-tune: every weight trains), ``"lora"`` (frozen base, trained
low-rank adapters) or ``"qlora"`` (LoRA over a base stored in NF4). ``r``, ``lora_alpha``,
``lora_dropout`` and ``target_modules`` mean what they mean in ``peft.LoraConfig``; the default
``target_modules="all-linear"`` is peft's "every linear projection except the output head".
``quantization`` says who stores QLoRA's NF4 base: ``"torchao"`` (``NF4Tensor``; every layout
but tensor parallelism) or ``"bitsandbytes"`` (``Linear4bit``, its CUDA kernels where a user has
a GPU, its CPU ones otherwise; no tensor parallelism, no ZeRO-3).

Example::

    >>> AdapterOptions.parse({"method": "lora", "r": 4}).lora_alpha
    16
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

METHODS = ("none", "lora", "qlora")
QUANTIZATIONS = ("torchao", "bitsandbytes")  # who stores QLoRA's NF4 base
ALL_LINEAR = "all-linear"  # peft's name for every Linear / Conv1D but the output head


@dataclass(frozen=True)
class AdapterOptions:
    """How a model is fine-tuned (see the module docstring)."""

    method: str = "none"
    r: int = 8  # rank of each adapter: A is (r, in), B is (out, r)
    lora_alpha: float = 16  # the update is B @ A scaled by lora_alpha / r
    lora_dropout: float = 0.0  # dropout on the adapter's input (the base path sees none)
    target_modules: Union[str, Sequence[str]] = ALL_LINEAR  # module names or name suffixes
    quantization: str = "torchao"  # QLoRA's NF4 base: torchao's NF4Tensor or bitsandbytes' 4-bit

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @classmethod
    def parse(cls, value: Union[None, str, Mapping[str, Any], AdapterOptions]) -> AdapterOptions:
        """Options from ``None`` (none), a method name, a mapping of fields, or options;
        ``ValueError`` naming every unknown key and bad value."""
        if isinstance(value, AdapterOptions):
            options = value
        elif value is None:
            options = cls()
        elif isinstance(value, str):
            options = cls(method=value)
        elif isinstance(value, Mapping):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(
                    f"unknown adapter option(s) {unknown}; valid options are {sorted(known)}"
                )
            given = dict(value)
            if not isinstance(given.get("target_modules", ALL_LINEAR), str):
                given["target_modules"] = tuple(given["target_modules"])
            options = cls(**given)
        else:
            raise ValueError(
                f"adapter={value!r} must be None, one of {METHODS} or a mapping of options"
            )
        problems = options.problems()
        if problems:
            raise ValueError("; ".join(problems))
        return options

    def problems(self) -> list[str]:
        out = []
        if self.method not in METHODS:
            out.append(f"adapter method={self.method!r} must be one of {METHODS}")
        if not (isinstance(self.r, int) and not isinstance(self.r, bool) and self.r >= 1):
            out.append(f"adapter r={self.r!r} must be a positive integer")
        if not (_number(self.lora_alpha) and self.lora_alpha > 0):
            out.append(f"adapter lora_alpha={self.lora_alpha!r} must be a positive number")
        if not (_number(self.lora_dropout) and 0 <= self.lora_dropout < 1):
            out.append(f"adapter lora_dropout={self.lora_dropout!r} must be in [0, 1)")
        if self.quantization not in QUANTIZATIONS:
            out.append(f"adapter quantization={self.quantization!r} must be one of {QUANTIZATIONS}")
        elif self.quantization != "torchao" and self.method != "qlora":
            out.append(
                f"adapter quantization={self.quantization!r} applies to method='qlora' only "
                f"(got method={self.method!r})"
            )
        targets = self.target_modules
        if isinstance(targets, str):
            if not targets:
                out.append("adapter target_modules='' names no module")
        elif not targets or not all(isinstance(t, str) and t for t in targets):
            out.append(f"adapter target_modules={targets!r} must be 'all-linear' or module names")
        return out

    def lora_config(self, base_model: Optional[str] = None) -> Any:
        """The ``peft.LoraConfig`` of these options (a new one each call: peft rewrites a
        config's ``target_modules`` into the concrete names it found)."""
        peft = require_peft()
        targets = (
            self.target_modules
            if isinstance(self.target_modules, str)
            else list(self.target_modules)
        )
        return peft.LoraConfig(
            r=self.r,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            target_modules=targets,
            bias="none",
            task_type="CAUSAL_LM",
            base_model_name_or_path=base_model,
        )

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if not isinstance(self.target_modules, str):
            out["target_modules"] = list(self.target_modules)
        return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def require_peft() -> Any:
    try:
        import peft
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("LoRA adapters need peft: pip install 'lightning-3d[lora]'") from err
    return peft
