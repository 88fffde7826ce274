"""LLaMA-Factory LoRA SFT with the routed experts on kt_ops.

Usage (the user's own LLaMA-Factory YAML, plus optional ``kt_*`` keys)::

    python -m kt_ops.integrations.llamafactory train examples/llamafactory_lora_sft.yaml
    python -m kt_ops.integrations.llamafactory train config.yaml max_steps=20 kt_lora_rank=8

LLaMA-Factory runs its own SFT (``llamafactory.train.tuner.run_exp``: data
loading and templates, ``CustomSeq2SeqTrainer``, logging, saving). One hook is
changed: ``llamafactory.model.loader.init_adapter``, which ``load_model``
calls right after the model is loaded and patched. The wrapper

1. moves the routed experts onto kt_ops (:func:`kt_ops.replace_experts`);
2. gives them kt_ops LoRA (:func:`kt_ops.lora.apply_lora`, PEFT's
   parametrisation) with LLaMA-Factory's ``lora_rank`` / ``lora_alpha`` /
   ``use_rslora`` unless ``kt_lora_rank`` / ``kt_lora_alpha`` say otherwise;
3. calls LLaMA-Factory's own ``init_adapter``, which applies PEFT LoRA to
   ``lora_target`` (attention, shared experts ...: ``all`` finds no linear layer
   in the kt_ops experts), then re-enables the kt_ops adapters that PEFT froze;
4. makes the PeftModel's ``save_pretrained`` write the experts' adapters too
   (:func:`kt_ops.peft_adapters.save_pretrained`), so the adapter directory the
   Trainer saves loads into plain transformers + PEFT.

``kt_*`` keys of the YAML (removed before LLaMA-Factory parses it):

==========================  ===============================================
``kt_lora_rank``            rank of the experts' LoRA (default ``lora_rank``)
``kt_lora_alpha``           alpha (default ``lora_alpha``)
``kt_lora_projections``     ``gate,up,down`` (default) or a subset
``kt_weight_format``        packed expert format (default ``bf16``)
``kt_num_threads``          kt_ops thread-pool size
``kt_backward_panels``      ``true``: keep the backward's transposed weights
                            (:func:`kt_ops.lora.keep_backward_panels`: 2 bytes
                            of host memory per expert weight for a 10-17%
                            faster backward; default ``false``)
==========================  ===============================================

Limits: ``finetuning_type: lora`` only (the packed experts are frozen), no
DoRA, no ``adapter_name_or_path`` (resume with
:func:`kt_ops.peft_adapters.load_adapter` instead), single process on the CPU.

**Installing LLaMA-Factory next to kt_ops.** ``llamafactory==0.9.5`` (PyPI)
pins ``transformers<=5.6.0``, ``peft<=0.18.1``, ``accelerate<=1.11.0``,
``trl<=0.24.0``, ``datasets<=4.0.0`` and needs ``torchaudio``; pip resolves that
by replacing torch 2.13.0 with 2.15.0 and transformers 5.23.0 with 5.6.0, which
kt_ops is not built for, and peft 0.18.1 cannot load the experts' adapters
(:data:`kt_ops.peft_adapters.MIN_PEFT_VERSION`). What works, and what CI runs
``tests/test_llamafactory.py`` in, is one command::

    bash scripts/setup_llamafactory.sh   # prints the venv's python on its last line

It makes a venv with ``--system-site-packages`` on top of this environment, installs
``llamafactory==0.9.5`` with ``--no-deps`` and ``datasets==4.0.0 trl==0.24.0 omegaconf``
under a constraints file that it writes from this environment's torch, transformers, peft,
accelerate, tokenizers, huggingface_hub, safetensors and numpy (cached in
``~/.cache/kt_ops/llamafactory-venv``).

``torchaudio`` has no build for torch 2.13 (the newest, 2.11.0, links
``libc10_cuda.so`` and fails to load), yet LLaMA-Factory's data package imports
it unconditionally (``llamafactory/data/mm_plugin.py``). For text-only SFT this
entry point therefore installs a stand-in ``torchaudio`` module (any attribute
access raises ``ImportError``) when the real one cannot be imported, and sets
``DISABLE_VERSION_CHECK=1`` (LLaMA-Factory's own switch for its
``transformers<=5.6.0`` / ``peft<=0.20.0`` check) unless it is already set.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import yaml

import kt_ops
from kt_ops import peft_adapters
from kt_ops.distributed import keep_packed_experts_out_of_ddp
from kt_ops.lora import LORA_PROJECTIONS, apply_lora, keep_backward_panels, lora_parameters

__all__ = [
    "KtOptions",
    "load_config",
    "split_config",
    "make_init_adapter",
    "patch_llamafactory",
    "train",
    "main",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KtOptions:
    """The ``kt_*`` keys of a config (see the module docstring)."""

    lora_rank: Optional[int] = None
    lora_alpha: Optional[float] = None
    lora_projections: tuple[str, ...] = LORA_PROJECTIONS
    weight_format: str = "bf16"
    num_threads: Optional[int] = None
    backward_panels: bool = False


def load_config(path: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """A LLaMA-Factory YAML as a dict, with ``key=value`` overrides (values parsed as YAML).

    Raises ``ValueError`` for an override without ``=`` or a file that is not a mapping.
    """
    with open(path) as f:
        config = yaml.safe_load(f) or {}
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a mapping of LLaMA-Factory arguments")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not key=value")
        config[key.strip()] = yaml.safe_load(value)
    return config


def split_config(config: dict[str, Any]) -> tuple[dict[str, Any], KtOptions]:
    """``(LLaMA-Factory's arguments, KtOptions)``: the ``kt_*`` keys taken out.

    Raises ``ValueError`` for an unknown ``kt_*`` key or an invalid value.
    """
    lf = {k: v for k, v in config.items() if not k.startswith("kt_")}
    kt = {k[3:]: v for k, v in config.items() if k.startswith("kt_")}
    known = set(KtOptions.__dataclass_fields__)
    unknown = sorted(set(kt) - known)
    if unknown:
        raise ValueError(
            f"unknown kt_ops options {['kt_' + k for k in unknown]}; known: "
            f"{sorted('kt_' + k for k in known)}"
        )
    if "lora_projections" in kt:
        value = kt["lora_projections"]
        items = value.split(",") if isinstance(value, str) else list(value)
        kt["lora_projections"] = tuple(p.strip() for p in items if p.strip())
        bad = [p for p in kt["lora_projections"] if p not in LORA_PROJECTIONS]
        if bad or not kt["lora_projections"]:
            raise ValueError(f"kt_lora_projections: {value!r}; expected a subset of gate,up,down")
    if not isinstance(kt.get("backward_panels", False), bool):
        raise ValueError(f"kt_backward_panels: {kt['backward_panels']!r}; expected true or false")
    return lf, KtOptions(**kt)


def _enable_kt_lora(model) -> None:
    for _, p in lora_parameters(model):
        p.requires_grad_(True)


def _patch_save(peft_model) -> None:
    """Make ``peft_model.save_pretrained`` also write the kt_ops experts' adapters."""

    def save_pretrained(save_directory, **kwargs):
        return peft_adapters.save_pretrained(peft_model, save_directory, **kwargs)

    peft_model.save_pretrained = save_pretrained


def make_init_adapter(original: Callable, options: KtOptions = KtOptions()) -> Callable:
    """Wrap LLaMA-Factory's ``init_adapter(config, model, model_args, finetuning_args,
    is_trainable)`` so that the experts run (and train LoRA) on kt_ops.

    Raises:
        NotImplementedError: ``adapter_name_or_path`` is set (LLaMA-Factory would load or
            merge PEFT adapters into experts that no longer exist as PEFT targets).
        ValueError: training with ``finetuning_type`` other than ``lora``, or DoRA.
    """

    def init_adapter(config, model, model_args, finetuning_args, is_trainable):
        if getattr(model_args, "adapter_name_or_path", None):
            raise NotImplementedError(
                "kt_ops + LLaMA-Factory: adapter_name_or_path is not supported (LLaMA-Factory "
                "would load the adapter with PEFT into the original experts); load it with "
                "kt_ops.peft_adapters.load_adapter(model, path) instead"
            )
        lora = bool(is_trainable) and finetuning_args.finetuning_type == "lora"
        if is_trainable and not lora:
            raise ValueError(
                f"kt_ops + LLaMA-Factory: finetuning_type={finetuning_args.finetuning_type!r} "
                "is not supported; the packed experts are frozen, use finetuning_type: lora"
            )
        if lora and getattr(finetuning_args, "use_dora", False):
            raise ValueError("kt_ops + LLaMA-Factory: DoRA is not supported on kt_ops experts")
        kt_ops.replace_experts(model, options.weight_format)
        if lora:
            names = apply_lora(
                model,
                rank=options.lora_rank or finetuning_args.lora_rank,
                alpha=options.lora_alpha or finetuning_args.lora_alpha,
                target_projections=options.lora_projections,
                use_rslora=bool(getattr(finetuning_args, "use_rslora", False)),
            )
            logger.info("kt_ops: LoRA on the experts of %d MoE layers", len(names))
            if options.backward_panels:
                kept = keep_backward_panels(model)
                logger.info("kt_ops: backward panels kept: %.1f MiB", kept / 2**20)
        model = original(config, model, model_args, finetuning_args, is_trainable)
        if lora:
            _enable_kt_lora(model)  # PEFT's get_peft_model froze everything but its own adapters
            if hasattr(model, "peft_config"):
                _patch_save(model)
        # The Trainer wraps this (PEFT) model in DDP when several ranks train: its
        # packed experts stay off DDP's buffer broadcast (one copy per host).
        keep_packed_experts_out_of_ddp(model)
        return model

    return init_adapter


def _ensure_torchaudio() -> None:
    """Install a stand-in ``torchaudio`` when the real one cannot be imported (text-only SFT)."""
    try:
        importlib.import_module("torchaudio")
        return
    except (ImportError, OSError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
    sys.modules.pop("torchaudio", None)  # a failed import may leave a half-made module
    # transformers checks its optional backends with importlib.util.find_spec when it is first
    # imported (and caches the answers); a module without __spec__ in sys.modules makes that
    # check raise ValueError. Import it first, so that it records torchaudio as absent.
    importlib.import_module("transformers")
    stub = types.ModuleType("torchaudio")
    stub.__doc__ = "kt_ops stand-in: torchaudio could not be imported"

    def __getattr__(name):
        if name.startswith("__"):  # hasattr(module, "__file__") and friends: plain absence
            raise AttributeError(name)
        raise ImportError(f"torchaudio is unavailable ({reason}); audio data needs it")

    stub.__getattr__ = __getattr__
    sys.modules["torchaudio"] = stub
    logger.warning("kt_ops: torchaudio unavailable (%s); a stand-in serves text-only SFT", reason)


def _import_llamafactory():
    """Import LLaMA-Factory's loader and tuner modules (after the environment fixes)."""
    if "DISABLE_VERSION_CHECK" not in os.environ:
        os.environ["DISABLE_VERSION_CHECK"] = "1"
        logger.warning(
            "kt_ops: DISABLE_VERSION_CHECK=1 (LLaMA-Factory 0.9.5 checks for transformers<=5.6.0 "
            "and peft<=0.20.0; kt_ops runs it with transformers %s)",
            importlib.import_module("transformers").__version__,
        )
    _ensure_torchaudio()
    loader = importlib.import_module("llamafactory.model.loader")
    tuner = importlib.import_module("llamafactory.train.tuner")
    return loader, tuner


@contextlib.contextmanager
def patch_llamafactory(options: KtOptions = KtOptions()) -> Iterator[Any]:
    """Within the block, LLaMA-Factory's ``load_model`` puts the experts on kt_ops.

    Yields ``llamafactory.train.tuner`` (call its ``run_exp``). Restores the hook on exit.

    Raises:
        ImportError: LLaMA-Factory is not installed (see the module docstring).
    """
    loader, tuner = _import_llamafactory()
    original = loader.init_adapter
    loader.init_adapter = make_init_adapter(original, options)
    try:
        yield tuner
    finally:
        loader.init_adapter = original


def train(config: dict[str, Any], callbacks: Optional[list] = None) -> None:
    """Run LLaMA-Factory's training (``run_exp``) on ``config`` with the experts on kt_ops.

    ``config`` is a LLaMA-Factory argument dict, optionally with ``kt_*`` keys.
    """
    lf_args, options = split_config(config)
    if options.num_threads:
        kt_ops.set_num_threads(options.num_threads)
    with patch_llamafactory(options) as tuner:
        tuner.run_exp(args=lf_args, callbacks=callbacks)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m kt_ops.integrations.llamafactory train CONFIG.yaml [key=value ...]``."""
    parser = argparse.ArgumentParser(
        prog="python -m kt_ops.integrations.llamafactory",
        description="LLaMA-Factory LoRA SFT with the routed experts on kt_ops",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="run LLaMA-Factory's training on a YAML config")
    p_train.add_argument("config", help="LLaMA-Factory YAML (may hold kt_* keys)")
    p_train.add_argument("overrides", nargs="*", help="key=value overrides")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    train(load_config(args.config, args.overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
