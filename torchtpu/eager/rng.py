"""Device RNG: CUDA's seed + offset (Philox-style) model on jax.random.

Each random op takes the generator's (seed, offset) and advances the offset by one; the key
is derived inside the compiled program, so a random op costs no extra dispatch and its cache
entry is independent of the seed.
"""
from __future__ import annotations

import hashlib
import random as _pyrandom
import weakref

import jax
import numpy as np
import torch


class GeneratorState:
    __slots__ = ("seed", "offset")

    def __init__(self, seed: int):
        self.seed = seed & 0xFFFFFFFFFFFFFFFF
        self.offset = 0

    def get_state(self) -> torch.Tensor:
        """16 bytes: seed then offset, little-endian uint64 (CUDA's layout)."""
        return torch.from_numpy(np.array([self.seed, self.offset], dtype="<u8").view(np.uint8).copy())

    def set_state(self, state: torch.Tensor) -> None:
        raw = state.detach().cpu().contiguous().view(torch.uint8).numpy()
        if raw.size != 16:
            raise RuntimeError(f"RNG state is wrong size: expected 16 bytes, got {raw.size}")
        self.seed, self.offset = (int(v) for v in raw.view("<u8"))


_DEFAULT_SEED = 67280421310721  # PyTorch's default_rng_seed_val
_default: dict[int, GeneratorState] = {}
_generators: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def default_state(index: int = 0) -> GeneratorState:
    s = _default.get(index)
    if s is None:
        s = _default[index] = GeneratorState(_DEFAULT_SEED)
    return s


# A tpu Generator (device/extras.py) is a Python subclass of torch._C.Generator over a CPU
# generator. The dispatcher hands a kernel that C++ generator in a fresh plain wrapper, without
# the subclass's attributes; so each tpu generator seeds its CPU generator with a tag of its own,
# which finds it again here (it once read the plain wrapper's CPU seed at offset 0 on every call:
# an explicit generator's seed was ignored and every draw repeated the first).
_TAG_BASE = 0x7470755F00000000  # "tpu_" in the high bytes
_tags = [0]
_by_tag: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def register_generator(gen) -> None:
    """Tag ``gen`` (a tpu Generator carrying ``_tpu_state``) so ``state_for`` finds it from the
    plain wrapper the dispatcher passes."""
    _tags[0] += 1
    tag = _TAG_BASE | _tags[0]
    torch._C.Generator.manual_seed(gen, tag)
    _by_tag[tag] = gen


def state_for(gen) -> GeneratorState:
    if gen is None:
        return default_state(0)
    s = getattr(gen, "_tpu_state", None)
    if s is not None:
        return s
    owner = _by_tag.get(gen.initial_seed())
    if owner is not None:
        return owner._tpu_state
    if gen.device.type != "tpu":
        raise RuntimeError(f"Expected a 'tpu' device type for generator but found "
                           f"'{gen.device.type}'")
    s = _generators.get(gen)
    if s is None:
        s = _generators[gen] = GeneratorState(gen.initial_seed())
    return s


def cpu_generator_for(gen):
    """The CPU generator a CPU fallback of a random op draws from in place of ``gen``: for a tpu
    generator a fresh CPU generator seeded from its (seed, offset), which advances as one random
    op does, so re-seeding the tpu generator draws the same values again (the tpu generator's
    own C++ generator holds only its tag); any other generator as it is."""
    s = getattr(gen, "_tpu_state", None)
    if s is None:
        owner = _by_tag.get(gen.initial_seed())
        s = owner._tpu_state if owner is not None else _generators.get(gen)
    if s is None:
        return gen
    words = next_state_of(s)
    digest = hashlib.sha256(words.tobytes()).digest()
    cpu = torch.Generator("cpu")
    cpu.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return cpu


def next_state_of(s: GeneratorState) -> np.ndarray:
    off = s.offset
    s.offset = off + 1
    seed = s.seed
    return np.array([seed & 0xFFFFFFFF, seed >> 32, off & 0xFFFFFFFF, off >> 32], dtype=np.uint32)


def next_state(gen=None) -> np.ndarray:
    """The (seed, offset) words for one random op; advances the generator."""
    return next_state_of(state_for(gen))


def key_from(words):
    """A jax.random key from the traced (seed, offset) words."""
    k = jax.random.key(words[0])
    k = jax.random.fold_in(k, words[1])
    k = jax.random.fold_in(k, words[2])
    return jax.random.fold_in(k, words[3])


def manual_seed(seed: int, index: int | None = None) -> None:
    idx = [index] if index is not None else list(range(max(len(_default), 1)))
    for i in idx:
        st = default_state(i)
        st.seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        st.offset = 0


def seed(index: int = 0) -> int:
    s = _pyrandom.getrandbits(63)
    manual_seed(s, index)
    return s
