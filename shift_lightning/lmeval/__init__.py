"""lm-evaluation-harness integration: the ``shift`` model, a saved folder with its adapters.

``lm_eval --model hf`` cannot load a pruned + corrected folder (its adapters live in hooks), so this
module registers :class:`ShiftLM` as ``--model shift``: lm-eval's own ``HFLM`` (same tokenisation,
batching, metrics, every task) with the model loaded by :func:`shift_lightning.load_pretrained`
(no remote code; adapter-only folders, HF ids, ``.gguf`` files and embedded names such as
``smollm2-135m`` work too). ``peft=<adapter folder>`` puts a PEFT adapter (a LoRA recovery's
``lora/``) on top.

lm-eval 0.4.13 finds models through its registry only (no plugin entry points), so the harness's
own ``lm_eval`` command does not know ``shift``; run it through this module, which registers the
model and then hands the command line to the harness unchanged::

    python -m shift_lightning.lmeval --model shift --model_args pretrained=outputs/x --tasks arc_easy,piqa --device cpu

or from Python (importing this module registers the name)::

    import lm_eval, shift_lightning.lmeval
    lm_eval.simple_evaluate(model="shift", model_args="pretrained=outputs/x", tasks=["arc_easy"])

lm-eval is an optional extra: nothing else in the package imports this module
(``tests/test_structure.py`` checks it).
"""

from __future__ import annotations

import json
import os

import torch

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as e:  # an optional extra
    raise ImportError("shift_lightning.lmeval needs lm-evaluation-harness: pip install 'lm-eval==0.4.13' "
                      "(or the project's [lmeval] extra)") from e

#: ``--model_args dtype=`` values (``auto``: as saved).
_DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")

#: HFLM loading options that make no sense for a model loaded by ``load_pretrained``.
_UNSUPPORTED = ("delta", "autogptq", "gptqmodel", "gguf_file", "parallelize", "tp_plan", "revision", "subfolder")


def check_model_args(pretrained, dtype, peft, kwargs: dict) -> None:
    """``--model shift``'s arguments, checked before anything loads (the entry point calls it before the harness
    indexes its tasks, which takes seconds)."""
    from ..errors import ConfigError
    from ..models import check_source

    if not pretrained:
        raise ConfigError("--model shift needs --model_args pretrained=<a saved folder, an HF id or folder, a .gguf "
                          "or an embedded name such as smollm2-135m>")
    if isinstance(dtype, str) and dtype not in _DTYPES:
        raise ConfigError(f"--model_args dtype={dtype}: not a dtype here; choose one of {', '.join(_DTYPES)}")
    check_source(str(pretrained))
    given = sorted(k for k in _UNSUPPORTED if kwargs.get(k) not in (None, False, "", "main"))
    if given:
        raise ConfigError(f"--model shift does not support {given}: the folder is loaded by "
                          "shift_lightning.load_pretrained")
    if peft and not os.path.isdir(os.path.expanduser(str(peft))):
        raise ConfigError(f"--model_args peft={peft}: no such adapter folder (a LoRA recovery's lora/)")
    if peft and not os.path.exists(os.path.join(os.path.expanduser(str(peft)), "adapter_model.safetensors")):
        found = sorted(f for f in os.listdir(os.path.expanduser(str(peft))) if f.endswith((".bin", ".pt", ".pth")))
        raise ConfigError(f"--model_args peft={peft}: no adapter_model.safetensors"
                          + (f" (only {', '.join(found)}: a pickle, which is never unpickled)" if found else "")
                          + "; save the adapter with safe_serialization (PEFT's default)")


@register_model("shift", "shift-lightning")
class ShiftLM(HFLM):
    """``HFLM`` over ``shift_lightning.load_pretrained(pretrained, dtype)``: a saved folder with its
    adapters (or any model the loader reads). ``dtype``: ``auto`` (as saved), ``float32``, ``bfloat16``,
    ``float16``, ``float64``; ``device``: ``cuda`` / ``cpu`` / ``cuda:N`` (default: cuda if available);
    ``peft``: a PEFT adapter folder applied on top. Every other HFLM option (``batch_size``,
    ``max_length``, ``add_bos_token``, …) works as for ``--model hf``."""

    def __init__(self, pretrained=None, dtype: str | torch.dtype | None = "auto", device: str | None = None,
                 peft: str | None = None, **kwargs):
        from ..checkpoint import load_pretrained

        check_model_args(pretrained, dtype, peft, kwargs)
        for k in (*_UNSUPPORTED, "trust_remote_code"):  # load_pretrained never runs a folder's code
            kwargs.pop(k, None)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and "LOCAL_RANK" in os.environ:  # `accelerate launch`: one GPU per process
            device = f"cuda:{os.environ['LOCAL_RANK']}"
        self._loaded = load_pretrained(str(pretrained), dtype=None if dtype in (None, "auto") else dtype,
                                       device=device)
        self._peft_path = peft
        super().__init__(pretrained=str(pretrained), device=device, backend="causal", **kwargs)

    def _get_config(self, pretrained, **kwargs) -> None:
        self._config = self._loaded[0].config

    def _create_tokenizer(self, pretrained, tokenizer, **kwargs) -> None:
        if tokenizer:
            return super()._create_tokenizer(pretrained, tokenizer, **kwargs)
        if self._loaded[1] is None:
            from ..errors import ConfigError

            raise ConfigError(f"{pretrained} has no tokenizer: pass --model_args tokenizer=<name or folder>")
        self.tokenizer = self._loaded[1]

    def _create_model(self, pretrained, **kwargs) -> None:
        model = self._loaded[0]
        if self._peft_path:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, self._peft_path)
        self._model = model.eval()


def main(argv: list[str] | None = None) -> None:
    """``lm_eval``'s command line with ``--model shift`` registered (importing this module did)."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    from ..errors import ShiftError

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        _check_hf_on_our_folder(sys.argv[1:])
        _check_shift_args(sys.argv[1:])
        cli_evaluate()
    except ShiftError as e:  # a mistake in the arguments or the model: one line, exit 2 (as our entry points)
        if "--debug" in sys.argv:
            raise
        sys.stderr.write(f"error: {' '.join(str(e).split())}\n")
        raise SystemExit(2) from None


def _flag(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _check_shift_args(argv: list[str]) -> None:
    """``--model shift``'s arguments as the harness will parse them, checked before it indexes its tasks."""
    if _flag(argv, "--model") not in ("shift", "shift-lightning"):
        return
    from lm_eval.utils import simple_parse_args_string

    args = simple_parse_args_string(_flag(argv, "--model_args"))
    check_model_args(args.pop("pretrained", None), args.pop("dtype", "auto"), args.pop("peft", None), args)


def _check_hf_on_our_folder(argv: list[str]) -> None:
    """``--model hf`` on a folder with maps would reach transformers' remote-code refusal (a traceback): ours to say."""
    from ..checkpoint import is_shift_folder
    from ..errors import ConfigError

    if _flag(argv, "--model") not in ("hf", "hf-auto", "huggingface"):
        return
    args = dict(kv.split("=", 1) for kv in (_flag(argv, "--model_args") or "").split(",") if "=" in kv)
    path = args.get("pretrained")
    if path and os.path.isdir(os.path.expanduser(path)) and is_shift_folder(os.path.expanduser(path)) \
            and os.path.exists(os.path.join(os.path.expanduser(path), "lra.safetensors")):
        spec = json.loads(open(os.path.join(os.path.expanduser(path), "shift_config.json")).read())
        if spec.get("adapters") or spec.get("branch_maps") or spec.get("weights") == "adapters":
            raise ConfigError(f"{path} is a shift-lightning folder with maps, which --model hf cannot run (they need "
                              "this package's loader, not remote code): use --model shift --model_args "
                              f"pretrained={path}")
