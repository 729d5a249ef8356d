"""Where the weights live while a pass walks the model (``--model.placement``).

The block-major walks (:mod:`shift_lightning.calibration.pipeline`) touch the model one piece at a time:
the embedding once per window, then each block for all of a rank's windows. They ask a placement for
each piece as they reach it:

``memory``   the whole model is in host (or device) memory, as :func:`~shift_lightning.models.load_model`
             built it; bringing a piece in is a no-op.
``onload``   the model is built on the meta device (accelerate's ``init_empty_weights``: parameters meta,
             buffers such as rotary frequencies real); a piece's weights are read from the folder's
             memory-mapped safetensors files when the walk reaches it, cast to the run's dtype, moved to
             the device, used for every window and released again (parameters back on ``meta``). The
             page cache holds the file's pages, shared by every process of a node; a pass reads the model
             once. Peak memory: one block's weights in the compute dtype, not the model's.
``auto``     ``onload`` when the model is a local safetensors folder whose weights, in the run's dtype,
             would take more than half of the memory available now; ``memory`` otherwise.

The placement travels with the model (``model.shift_placement``, read by :func:`placement_of`): an
onloaded model is a skeleton whose blocks are meta until a placement brings them in.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from .arch import ModelLoadError, decoder_layers
from .errors import ConfigError

log = logging.getLogger(__name__)

PLACEMENTS = ("auto", "memory", "onload")


class InMemory:
    """Every weight is where the model is: bringing a piece in changes nothing."""

    name = "memory"
    onloaded = False

    @contextlib.contextmanager
    def block(self, model: nn.Module, i: int, device=None) -> Iterator[nn.Module]:
        """Block ``i`` of ``model`` (its index in the model as it is now) with its weights in place."""
        yield decoder_layers(model)[i]

    @contextlib.contextmanager
    def piece(self, module: nn.Module, prefix: str, device=None) -> Iterator[nn.Module]:
        yield module


IN_MEMORY = InMemory()


class Onloaded:
    """Weights read per piece from a folder's safetensors files (see the module doc).

    ``folder``: an HF folder with ``model.safetensors`` or a sharded ``model.safetensors.index.json``;
    ``dtype``: the compute dtype every tensor is cast to on the way in; ``sources[i]``: the tensor-name
    prefix of the model's block ``i`` (``model.layers.{orig}.``; after pruning, the kept blocks' original
    indices)."""

    name = "onload"
    onloaded = True

    def __init__(self, folder: str | Path, dtype: torch.dtype, num_layers: int):
        self.folder, self.dtype = Path(folder), dtype
        self.files = weight_index(self.folder)
        self.sources = [f"model.layers.{i}." for i in range(num_layers)]
        self._open: dict[str, object] = {}
        self.bytes_read = 0

    def _handle(self, file: str):
        from safetensors import safe_open

        if file not in self._open:
            self._open[file] = safe_open(str(self.folder / file), framework="pt", device="cpu")
        return self._open[file]

    def tensor(self, name: str) -> torch.Tensor:
        """One stored tensor, as stored (no cast)."""
        if name not in self.files:
            raise ModelLoadError(f"{self.folder}: no tensor {name!r} in its safetensors files; the folder does not "
                                 "match its config.json")
        t = self._handle(self.files[name]).get_tensor(name)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def load(self, module: nn.Module, prefix: str, device=None) -> None:
        """Read ``module``'s parameters (``prefix + name``) into it, cast and on ``device``."""
        from accelerate.utils import set_module_tensor_to_device

        device = torch.device(device or "cpu")
        for name, p in list(module.named_parameters()):
            t = self.tensor(prefix + name)
            if tuple(t.shape) != tuple(p.shape):
                raise ModelLoadError(f"{self.folder}: {prefix + name} has shape {tuple(t.shape)}, the model "
                                     f"expects {tuple(p.shape)}")
            set_module_tensor_to_device(module, name, device, value=t, dtype=self.dtype)
        for name, b in list(module.named_buffers()):  # rotary frequencies etc. are real: move them along
            if b.device != device and not b.is_meta:
                set_module_tensor_to_device(module, name, device)

    @staticmethod
    def release(module: nn.Module) -> None:
        """Free ``module``'s parameters (back on the meta device)."""
        from accelerate.utils import set_module_tensor_to_device

        for name, _ in list(module.named_parameters()):
            set_module_tensor_to_device(module, name, "meta")

    @contextlib.contextmanager
    def piece(self, module: nn.Module, prefix: str, device=None) -> Iterator[nn.Module]:
        """``module`` with its weights (``prefix`` + name in the files) for the length of the ``with``."""
        self.load(module, prefix, device)
        try:
            yield module
        finally:
            self.release(module)

    @contextlib.contextmanager
    def block(self, model: nn.Module, i: int, device=None) -> Iterator[nn.Module]:
        with self.piece(decoder_layers(model)[i], self.sources[i], device) as b:
            yield b

    def pruned(self, kept: list[int]) -> None:
        """The model lost blocks: its block ``p`` is the original block ``kept[p]``."""
        self.sources = [self.sources[i] for i in kept]


def placement_of(model: nn.Module):
    """The model's placement (:data:`IN_MEMORY` unless it was built as an onloaded skeleton)."""
    return getattr(model, "shift_placement", IN_MEMORY)


def weight_index(folder: Path) -> dict[str, str]:
    """Tensor name -> safetensors file of an HF folder (single file or sharded with an index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"{index} is damaged ({e}); download or copy the folder again") from None
    single = folder / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {k: single.name for k in f.keys()}
    raise ModelLoadError(f"--model.placement onload reads the weights from safetensors files, and {folder} has "
                         "neither model.safetensors nor model.safetensors.index.json: use --model.placement memory")


def weights_bytes(folder: Path, dtype: torch.dtype) -> int | None:
    """The size of a local folder's weights in ``dtype`` (None when it has no safetensors files)."""
    try:
        files = set(weight_index(folder).values())
    except ModelLoadError:
        return None
    from safetensors import safe_open

    total = 0
    for file in files:
        with safe_open(str(folder / file), framework="pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total * torch.empty(0, dtype=dtype).element_size()


def available_memory() -> int:
    """Bytes of host memory available now (``MemAvailable``; the cgroup's limit if lower)."""
    avail = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            v = int(Path(limit).read_text().strip())
            avail = v if avail is None else min(avail, v)
    return avail if avail is not None else (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def resolve(placement: str, folder: Path | None, dtype: torch.dtype) -> str:
    """``auto`` -> ``memory`` or ``onload`` (see the module doc); checks that ``onload`` can read ``folder``."""
    if placement not in PLACEMENTS:
        raise ConfigError(f"--model.placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if placement == "memory":
        return placement
    size = weights_bytes(folder, dtype) if folder is not None and folder.is_dir() else None
    if placement == "onload":
        if size is None:
            raise ConfigError(f"--model.placement onload reads a local folder of safetensors files; "
                              f"{folder or 'this model'} is not one (an embedded, GGUF, hub or tiny model): "
                              "use --model.placement memory")
        return placement
    if size is not None and size > available_memory() // 2:
        log.info("The weights take %.1f GB in %s, more than half of the memory available: onloading them block by "
                 "block (--model.placement memory to load them whole)", size / 1e9, dtype)
        return "onload"
    return "memory"


def build_onloaded(folder: Path, dtype: torch.dtype, trust_remote_code: bool = False):
    """The model of ``folder`` as a skeleton: built on the meta device (buffers real), the embedding, final norm
    and head meta too; every piece is read when a walk asks for it. Returns the model with its placement."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.eval()
    model.shift_placement = Onloaded(folder, dtype, len(decoder_layers(model)))
    return model
