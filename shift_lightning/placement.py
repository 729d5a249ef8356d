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
             once. The input embedding is looked up, not read whole: a batch reads the rows of its token ids
             (:meth:`Onloaded.lookup`). Peak memory: one block's weights in the compute dtype, not the model's.
``auto``     ``onload`` when the model is a local safetensors folder whose weights, in the run's dtype,
             would take more than half of the memory available now; ``memory`` otherwise.

The placement travels with the model (``model.shift_placement``, read by :func:`placement_of`): an
onloaded model is a skeleton whose blocks are meta until a placement brings them in.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import json
import logging
import math
import os
import weakref
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from .arch import ModelLoadError, decoder_layers
from .errors import ConfigError

log = logging.getLogger(__name__)

PLACEMENTS = ("auto", "memory", "onload")
_STORED_SIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1}


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

    lookup = piece


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
        self._loaded: dict[int, set[str]] = {}
        self.folds: dict[str, list] = {}
        self.overrides: dict[str, dict[str, torch.Tensor]] = {}
        self.bytes_read = 0
        self.model = None  # a weak reference to the skeleton (its tied head is tied again after a release)

    def _handle(self, file: str):
        from safetensors import safe_open

        if file not in self._open:
            self._open[file] = safe_open(str(self.folder / file), framework="pt", device="cpu")
        return self._open[file]

    def _stored_name(self, name: str) -> str:
        """The file's name of a parameter: a map wrapped around a norm (``BranchMap``) keeps the norm's name."""
        if name not in self.files:
            plain = name.replace("post_feedforward_layernorm.norm.", "post_feedforward_layernorm.")
            if plain in self.files:
                return plain
            if name == "lm_head.weight" and "model.embed_tokens.weight" in self.files:  # tied: the head is the table
                return "model.embed_tokens.weight"
            raise ModelLoadError(f"{self.folder}: no tensor {name!r} in its safetensors files; the folder does not "
                                 "match its config.json")
        return name

    def tensor(self, name: str, dtype: torch.dtype | None = None, device=None, chunk: int = 1 << 24) -> torch.Tensor:
        """One stored tensor, cast to ``dtype`` on ``device``; a large one is cast a few rows at a time from the
        memory-mapped file (no full copy in the stored dtype beside the cast one)."""
        name = self._stored_name(name)
        sl = self._handle(self.files[name]).get_slice(name)
        shape = sl.get_shape()
        dtype, device = dtype or self.dtype, torch.device(device or "cpu")
        if len(shape) < 2 or math.prod(shape) <= chunk:  # a copy: a slice of the stored dtype may be the mapped
            out = sl[:].to(device=device, dtype=dtype, copy=True)  # file's pages, which a fold would change in place
        else:
            out = torch.empty(shape, dtype=dtype, device=device)
            rows = max(1, chunk // math.prod(shape[1:]))
            for r in range(0, shape[0], rows):
                out[r:r + rows] = sl[r:r + rows].to(device=device, dtype=dtype)
        self.bytes_read += math.prod(shape) * _STORED_SIZE.get(sl.get_dtype(), 4)
        return out

    def gather(self, name: str, index: list[int], dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        """Rows ``index`` (ascending, distinct) of a stored tensor, cast to ``dtype`` on ``device``: each run of
        consecutive rows read and cast as one slice of the memory-mapped file (the same values as those rows of
        :meth:`tensor`: a cast is elementwise)."""
        name = self._stored_name(name)
        sl = self._handle(self.files[name]).get_slice(name)
        shape = sl.get_shape()
        dtype, device = dtype or self.dtype, torch.device(device or "cpu")
        out = torch.empty((len(index), *shape[1:]), dtype=dtype, device=device)
        k = 0
        while k < len(index):
            e = k
            while e + 1 < len(index) and index[e + 1] == index[e] + 1:
                e += 1
            out[k:e + 1] = sl[index[k]:index[e] + 1].to(device=device, dtype=dtype)
            k = e + 1
        self.bytes_read += out.numel() * _STORED_SIZE.get(sl.get_dtype(), 4)
        return out

    def rows(self, name: str, i: int) -> torch.Tensor:
        """Row ``i`` of a stored tensor (a 1-D tensor: the whole of it), as stored."""
        name = self._stored_name(name)
        sl = self._handle(self.files[name]).get_slice(name)
        return sl[i:i + 1] if len(sl.get_shape()) > 1 else sl[:]

    def load(self, module: nn.Module, prefix: str, device=None) -> None:
        """Read ``module``'s meta parameters (``prefix + name`` in the files) into it, cast, on ``device``; then
        the folds registered for ``prefix`` (:meth:`after_load`) change them as surgery changed the skeleton."""
        from accelerate.utils import set_module_tensor_to_device

        device = torch.device(device or "cpu")
        for name, p in list(module.named_parameters()):
            if not p.is_meta:  # a map the repair added (e.g. ReplaceMe's around a norm): not in the files
                continue
            t = self.tensor(prefix + name, device=device)
            if tuple(t.shape) != tuple(p.shape):
                raise ModelLoadError(f"{self.folder}: {prefix + name} has shape {tuple(t.shape)}, the model "
                                     f"expects {tuple(p.shape)}")
            set_module_tensor_to_device(module, name, device, value=t)
            self._loaded.setdefault(id(module), set()).add(name)
        for name, b in list(module.named_buffers()):  # rotary frequencies etc. are real: move them along
            if b.device != device and not b.is_meta:
                set_module_tensor_to_device(module, name, device)
        for fold in self.folds.get(prefix, []):
            fold(module)
        with torch.no_grad():
            for name, t in self.overrides.get(prefix, {}).items():
                module.get_parameter(name).copy_(t)

    def after_load(self, prefix: str, fold) -> None:
        """Run ``fold(module)`` each time the piece stored under ``prefix`` is read (a weight fold surgery applied
        to the skeleton, where it changed nothing: ReplaceMe's map or the stock repair in a ``down_proj``)."""
        self.folds.setdefault(prefix, []).append(fold)

    def override(self, prefix: str, tensors: dict[str, torch.Tensor] | None) -> None:
        """Each time the piece under ``prefix`` is read, after its folds, its parameters ``tensors`` (names relative
        to the piece) are these values (weights fitted during the run: the kept-block re-fit); None: read from the
        files again."""
        if tensors is None:
            self.overrides.pop(prefix, None)
        else:
            self.overrides[prefix] = tensors

    def release(self, module: nn.Module) -> None:
        """Free what :meth:`load` read into ``module`` (back on the meta device); a tied head is tied again."""
        from accelerate.utils import set_module_tensor_to_device

        for name in self._loaded.pop(id(module), ()):
            set_module_tensor_to_device(module, name, "meta")
        model = self.model() if self.model is not None else None
        if model is not None and _ties(model):
            model.tie_weights()
        return_freed_memory()

    @contextlib.contextmanager
    def piece(self, module: nn.Module, prefix: str, device=None) -> Iterator[nn.Module]:
        """``module`` with its weights (``prefix`` + name in the files) for the length of the ``with``."""
        self.load(module, prefix, device)
        try:
            yield module
        finally:
            self.release(module)

    @contextlib.contextmanager
    def lookup(self, module: nn.Module, prefix: str, device=None) -> Iterator[nn.Module]:
        """The input embedding ``module`` for the length of the ``with``, answering each forward with the rows it looks
        up only: the call's distinct token ids are read from the files (:meth:`gather`) into a table of those rows and
        the ids renumbered into it. The same vectors as :meth:`piece` gives, without the whole table in the compute
        dtype (Llama-3's 128256 × 4096 in float32: 2.1 GB) for a batch's few hundred tokens. Read whole (:meth:`piece`)
        when surgery folds or overrides it, or when it is not a plain ``nn.Embedding``."""
        if self.folds.get(prefix) or self.overrides.get(prefix) or not isinstance(module, nn.Embedding) \
                or module.max_norm is not None:
            with self.piece(module, prefix, device) as m:
                yield m
            return
        device = torch.device(device or "cpu")
        meta, pad = module._parameters["weight"], module.padding_idx

        def rows(mod, args, kwargs):
            ids = args[0] if args else kwargs.pop("input")
            index, renumbered = torch.unique(ids, return_inverse=True)  # ascending
            table = self.gather(prefix + "weight", index.tolist(), device=device)
            mod._parameters["weight"] = nn.Parameter(table, requires_grad=meta.requires_grad)
            return (renumbered, *args[1:]), kwargs

        handle = module.register_forward_pre_hook(rows, with_kwargs=True)
        module.padding_idx = None  # the gradient's business only; the id may lie beyond the table of looked-up rows
        try:
            yield module
        finally:
            handle.remove()
            module._parameters["weight"], module.padding_idx = meta, pad  # the skeleton's meta Parameter (a tied head's)
            return_freed_memory()

    @contextlib.contextmanager
    def block(self, model: nn.Module, i: int, device=None) -> Iterator[nn.Module]:
        with self.piece(decoder_layers(model)[i], self.sources[i], device) as b:
            yield b

    def pruned(self, kept: list[int]) -> None:
        """The model lost blocks: its block ``p`` is the original block ``kept[p]``."""
        self.sources = [self.sources[i] for i in kept]


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def return_freed_memory() -> None:
    """Hand freed heap memory back to the system (glibc's ``malloc_trim``; nothing elsewhere). A block's cast chunks
    and activations are mid-size allocations glibc keeps in its heap: without this an onloaded walk grows by about
    30 MB a block (measured at Llama-3.1-8B's shape), 2 GB over an 8B model's two passes."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


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
    model.tie_weights()  # a tied head is the embedding's Parameter, as from_pretrained makes it
    model.eval()
    model.shift_placement = Onloaded(folder, dtype, len(decoder_layers(model)))
    model.shift_placement.model = weakref.ref(model)
    model.shift_placement.trust_remote_code = trust_remote_code
    return model


def original_copy(model: nn.Module) -> nn.Module:
    """``model`` as loaded, beside the one surgery changes (the kept-block re-fit's targets): in memory a deep copy
    of its weights; onloaded another skeleton over the same files (nothing read, nothing copied)."""
    pl = placement_of(model)
    if not pl.onloaded:
        return copy.deepcopy(model)
    return build_onloaded(pl.folder, pl.dtype, pl.trust_remote_code)


def _ties(model: nn.Module) -> bool:
    """Whether the model's config ties the LM head to the input embedding."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return bool(getattr(cfg, "tie_word_embeddings", False))


# --------------------------------------------------------------------------------------------
# Saving an onloaded model: its weights streamed from the source files, one piece at a time
# --------------------------------------------------------------------------------------------
_ST_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
             torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8", torch.bool: "BOOL"}


def write_safetensors(path: Path, layout: list[tuple[str, tuple, torch.dtype]], values, metadata: dict) -> None:
    """Write a safetensors file whose header (``layout``: name, shape, dtype in file order) is known before its
    tensors: ``values`` yields ``(name, tensor)`` in that order, each written and dropped, so the file is
    never held in memory whole."""
    import struct

    header: dict = {"__metadata__": metadata}
    off = 0
    for name, shape, dtype in layout:
        n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    values = iter(values)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype in layout:
            got, t = next(values)  # (not zip: it keeps the last pair, so two tensors would be alive at once)
            if got != name or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise RuntimeError(f"streamed tensor {got} {tuple(t.shape)} {t.dtype} where the header has {name} "
                                   f"{tuple(shape)} {dtype}")
            f.write(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data)
            del t  # before the next tensor is read: one at a time
        if next(values, None) is not None:
            raise RuntimeError(f"more streamed tensors than the header of {path} lists")


def save_streamed(model: nn.Module, state: dict[str, torch.Tensor], out: Path, max_shard_bytes: int = 5 << 30) -> None:
    """Write ``state`` (names and meta tensors of an onloaded, pruned, repaired skeleton, as ``save_pretrained``
    would save them) as HF safetensors files in ``out``: each kept block read from the source files, its folds
    applied, written and released; one ``model.safetensors``, or shards of at most ``max_shard_bytes`` (a block
    is never split) with ``model.safetensors.index.json``. Peak memory: one block (or one top-level tensor)."""
    pl: Onloaded = placement_of(model)
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and head.weight is emb.weight:  # tied: the head is the embedding, saved once (save_pretrained)
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    pieces: list[tuple[int | None, list[str]]] = []  # (block or None, names), in the state's order
    for k in state:
        blk = int(k.split(".")[2]) if k.startswith("model.layers.") else None
        if pieces and blk is not None and pieces[-1][0] == blk:
            pieces[-1][1].append(k)
        else:
            pieces.append((blk, [k]))

    def nbytes(names):
        return sum(state[k].numel() * state[k].element_size() for k in names)

    shards: list[list[tuple[int | None, list[str]]]] = [[]]
    for piece in pieces:
        if shards[-1] and sum(nbytes(n) for _, n in shards[-1]) + nbytes(piece[1]) > max_shard_bytes:
            shards.append([])
        shards[-1].append(piece)

    def values(shard):
        for blk, names in shard:
            if blk is None:
                for k in names:
                    yield k, pl.tensor(k, dtype=state[k].dtype)
                continue
            with pl.block(model, blk) as block:
                sd = block.state_dict()
                prefix = f"model.layers.{blk}."
                for k in names:
                    local = k[len(prefix):]
                    if local not in sd:  # the norm inside ReplaceMe's map (Gemma3) is saved under its own name
                        local = local.replace("post_feedforward_layernorm.", "post_feedforward_layernorm.norm.")
                    yield k, sd[local].to(state[k].dtype)
                del sd  # before the block is released: its weights are freed with it

    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        layout = [(k, tuple(state[k].shape), state[k].dtype) for _, names in shard for k in names]
        write_safetensors(out / file, layout, values(shard), {"format": "pt"})
        weight_map.update({k: file for k, _, _ in layout})
    if n > 1:
        total = sum(nbytes(names) for _, names in pieces)
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(out)
