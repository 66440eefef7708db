"""Fewer device programs per token in transformers' ``generate()`` loop on "tpu".

Around each decode step (compiled or eager) ``generate()`` runs a few dozen small tensor ops:
logits processors, stopping criteria, the stop check. On "tpu" each is an XLA program call
(~10-15 us of host time even on the C++ fast path), so ops whose results are known without
them are left out here, with the same results bit for bit:

- ``MinLengthLogitsProcessor`` / ``MinNewTokensLengthLogitsProcessor`` build
  ``isin(arange(vocab), eos)`` every token, also once the minimum length is reached and the
  mask is not used (``generate()`` adds ``MinLengthLogitsProcessor`` for every prompt:
  ``min_new_tokens=0`` becomes ``min_length=prompt length``). On "tpu" they return
  ``scores.clone()`` then, as transformers does, made without a program when ``scores`` is its
  storage's whole array (``_clone``: a new storage holding the same immutable jax array; a
  write to either replaces its own storage's array, and an array two storages hold is never
  donated); below the minimum the mask is made once per
  processor, vocabulary size and eos tensor (its version counter: an in-place change of the
  eos ids makes it again).
- ``StoppingCriteriaList`` starts from ``torch.full((batch,), False)`` and ORs each criterion
  into it; ``False | r`` is ``r`` for a criterion's ``(batch,)`` bool tensor, so the first such
  result starts the OR (copied, as ``_clone`` copies, when it is the only one, so the list
  still returns a tensor of its own, unless it is an ``EosTokenCriteria``'s, made for the
  call). ``MaxLengthCriteria`` answers ``full((batch,), done)`` with ``done`` a host bool: it is not called; ``False`` leaves
  the OR as it is, ``True`` makes it ``full((batch,), True)`` (the other criteria still run).
- ``LogitsProcessorList`` reads ``inspect.signature(processor.__call__)`` for every processor
  every token (~25 us of host time per token for generate()'s default list, 3% of a
  static-cache compiled token): on "tpu" the parameter names are read once per ``__call__``
  function (a bound method of the processor; anything else is read every call, as there).

- ``masking_utils.sdpa_mask`` builds a static-cache decode step's causal mask (outside the
  compiled step: ``prepare_inputs_for_generation`` makes it every token) from four ``arange``,
  two offset ``add`` and twelve ``unsqueeze``, then ``kv <= q``. On "tpu" (eager, the plain
  causal mask function, no skip allowed) the key positions ``arange(kv_length) + kv_offset``
  and ``arange(q_length)`` are made once per length, offset and device (constants, never
  handed out), so a token runs ``q + q_offset`` and ``<=`` only; a 2D padding mask is ANDed in
  as the original's ``padding_mask[batch, kv]`` reads it, a slice of the same values. One
  query (a decode token) at a 0-d integer tensor offset (a static cache's
  ``cumulative_length``) compares ``kv <= q_offset`` directly: ``arange(1) + q_offset`` holds
  ``q_offset`` and broadcasts to the same shape, so one program per token.
- ``GenerationMixin._update_model_kwargs_for_generation`` makes the next position ids as
  ``arange(n).view(1, ..., n) + position_ids[..., -1:] + 1`` (three programs); for integer
  position ids on "tpu" it is ``position_ids[..., -1:] + (arange(n) + 1)``, the second term
  made once per length, rank, dtype and device (integer addition wraps alike in any order),
  then transformers' ``cat``; the rest of the update is transformers' own. The next
  ``GenerationMixin.prepare_inputs_for_generation`` slices the grown ids' last ``n`` and
  clones them (contiguous): it is given that fresh ``last + (arange(n) + 1)`` instead, the
  same values, once, when asked for ``n`` positions and neither tensor changed in place since.

Counted: ``generate_programs_saved`` (per patch, in ``per_op``). Applied when the tensors are on
"tpu" only; ``TORCHTPU_GENERATE_STEPS=0`` turns it off.
"""
from __future__ import annotations

import functools
import inspect
import math
import os

from .hooks import patch

ENABLED = os.environ.get("TORCHTPU_GENERATE_STEPS", "1") != "0"


def _saved(what: str, n: int) -> None:
    from ..runtime.metrics import count

    count("generate_programs_saved", n, op=what)


def _on_tpu(t) -> bool:
    return ENABLED and getattr(getattr(t, "device", None), "type", None) == "tpu"


def _clone(t):
    """``t.clone()`` without a program when ``t`` is a tpu tensor that is its storage's whole
    array (offset 0, contiguous, the array's shape and dtype, no conj/neg bit, no autograd):
    a new tensor with a storage of its own holding the same jax array. jax arrays are
    immutable; a write to either tensor gives its own storage a new array, and an array that
    two storages hold is never donated to a write (the executors count its references).
    Anything else: ``t.clone()``. Returns (tensor, whether a program was saved)."""
    import torch

    from ..runtime import buffer as _buffer

    buf = getattr(t.untyped_storage(), "_tpu_buffer", None)
    if (type(buf) is _buffer.Buffer and t.layout == torch.strided and not t.requires_grad
            and not t.storage_offset() and t.is_contiguous() and not t.is_conj()
            and not t.is_neg()):
        arr = buf.array
        shape = tuple(arr.shape)
        # the dtype wrap gives the array's tensor
        if shape == tuple(t.shape) and _buffer._meta(shape, arr.dtype)[1] == t.dtype:
            return _buffer.wrap(arr), True
    return t.clone(), False


def eos_mask(proc, scores):
    """``isin(arange(vocab), proc.eos_token_id)`` on ``scores``' device, made once per
    processor, vocabulary size and eos tensor (and its version)."""
    import torch

    eos = proc.eos_token_id
    key = (scores.shape[-1], scores.device, id(eos), getattr(eos, "_version", None))
    held = proc.__dict__.get("_torchtpu_eos_mask")
    if held is not None and held[0] == key and held[2] is eos:
        _saved(type(proc).__name__, 2)
        return held[1]
    mask = torch.isin(torch.arange(scores.shape[-1], device=scores.device), eos)
    proc.__dict__["_torchtpu_eos_mask"] = (key, mask, eos)
    return mask


def _min_length(orig, new_tokens: bool):
    @functools.wraps(orig)
    def __call__(self, input_ids, scores):
        import torch

        if not _on_tpu(scores) or not isinstance(getattr(self, "eos_token_id", None),
                                                 torch.Tensor):
            return orig(self, input_ids, scores)
        if new_tokens:
            short = input_ids.shape[-1] - self.prompt_length_to_skip < self.min_new_tokens
        else:
            short = input_ids.shape[-1] < self.min_length
        if not short:
            out, shared = _clone(scores)
            _saved(type(self).__name__, 3 if shared else 2)  # arange, isin (, clone)
            return out
        return torch.where(eos_mask(self, scores), -math.inf, scores)

    return __call__


_KNOWN: dict = {}  # transformers' criteria classes whose results are known without a program


def _max_length_done(crit, input_ids) -> bool:
    """``MaxLengthCriteria``'s answer, a host bool it would broadcast with ``full`` (and its
    warning past the model's maximum length, as it gives it)."""
    cur_len = input_ids.shape[1]
    done = cur_len >= crit.max_length
    if crit.max_position_embeddings is not None and not done \
            and cur_len > crit.max_position_embeddings:
        _KNOWN["logger"].warning_once(
            "This is a friendly reminder - the current text generation call has exceeded the "
            f"model's predefined maximum length ({crit.max_position_embeddings}). Depending on "
            "the model, you may observe exceptions, performance degradation, or nothing at all.")
    return done


def _criteria(orig):
    @functools.wraps(orig)
    def __call__(self, input_ids, scores, **kwargs):
        import torch

        if not _on_tpu(input_ids) or not len(self):
            return orig(self, input_ids, scores, **kwargs)
        n = input_ids.shape[0]
        is_done = None
        alone = False  # is_done is a criterion's own result (not yet a tensor of ours)
        fresh = False  # ... and one the criterion made for this call (holds no reference to it)
        all_done = False  # a MaxLengthCriteria said True: the OR is all True
        ran = 0  # full / or / clone programs run here (transformers: a full, an or each)
        maxlen, eos = _KNOWN.get("max_length"), _KNOWN.get("eos")
        for criteria in self:
            if maxlen is not None and type(criteria) is maxlen:
                # its result is full((n,), done): False | r is r, True | r is True
                all_done |= _max_length_done(criteria, input_ids)
                continue
            r = criteria(input_ids, scores, **kwargs)
            if (is_done is None and isinstance(r, torch.Tensor) and r.dtype == torch.bool
                    and r.shape == (n,) and r.device == input_ids.device):
                is_done, alone = r, True  # False | r is r: no full, no or
                fresh = eos is not None and type(criteria) is eos  # isin(...).any(-1): new
                continue
            if is_done is None:
                is_done = torch.full((n,), False, device=input_ids.device, dtype=torch.bool)
                ran += 1
            is_done, alone = is_done | r, False
            ran += 1
        if all_done or is_done is None:
            is_done = torch.full((n,), all_done, device=input_ids.device, dtype=torch.bool)
            ran += 1
        elif alone and not fresh:
            is_done, shared = _clone(is_done)
            ran += 0 if shared else 1
        saved = 1 + len(self) + sum(1 for c in self if maxlen is not None and type(c) is maxlen)
        if saved > ran:
            _saved("StoppingCriteriaList", saved - ran)
        return is_done

    return __call__


_PARAMS: dict = {}  # a processor class's __call__ function -> its bound parameter names


def call_params(processor) -> tuple:
    """``tuple(inspect.signature(processor.__call__).parameters)``, read once per function
    when ``processor.__call__`` is a method bound to ``processor``."""
    call = processor.__call__
    fn = getattr(call, "__func__", None)
    if fn is None or getattr(call, "__self__", None) is not processor:
        return tuple(inspect.signature(call).parameters)
    names = _PARAMS.get(fn)
    if names is None:
        names = _PARAMS[fn] = tuple(inspect.signature(call).parameters)
    return names


def _processors(orig):
    @functools.wraps(orig)
    def __call__(self, input_ids, scores, **kwargs):
        if not _on_tpu(scores):
            return orig(self, input_ids, scores, **kwargs)
        for processor in self:  # LogitsProcessorList's loop, the names read once
            names = call_params(processor)
            if len(names) > 2:
                if not all(arg in kwargs for arg in names[2:]):
                    raise ValueError(
                        f"Make sure that all the required parameters: {list(names)} for "
                        f"{processor.__class__} are passed to the logits processor.")
                scores = processor(input_ids, scores, **kwargs)
            else:
                scores = processor(input_ids, scores)
        return scores

    return __call__


def _patch_logits(mod) -> None:
    patch(mod, "LogitsProcessorList.__call__", _processors, params=("input_ids", "scores"))
    patch(mod, "MinLengthLogitsProcessor.__call__",
          functools.partial(_min_length, new_tokens=False), params=("input_ids", "scores"))
    patch(mod, "MinNewTokensLengthLogitsProcessor.__call__",
          functools.partial(_min_length, new_tokens=True), params=("input_ids", "scores"))


def _patch_stopping(mod) -> None:
    for key, name in (("max_length", "MaxLengthCriteria"), ("eos", "EosTokenCriteria"),
                      ("logger", "logger")):
        if getattr(mod, name, None) is not None:
            _KNOWN[key] = getattr(mod, name)
    patch(mod, "StoppingCriteriaList.__call__", _criteria, params=("input_ids", "scores"))


_POSITIONS: dict = {}  # (length, offset, device) -> arange(length) + offset, 4-d views of it


def _positions(length: int, offset: int, device):
    """``(arange(length) + offset)`` on ``device`` as the key ``[None, None, None, :]`` and
    query ``[None, None, :, None]`` views ``sdpa_mask`` indexes with, made once; and whether
    it was made before."""
    import torch

    key = (length, offset, device)
    got = _POSITIONS.get(key)
    if got is not None:
        return got, True
    if len(_POSITIONS) > 256:
        _POSITIONS.clear()
    r = torch.arange(length, device=device) + offset
    got = _POSITIONS[key] = (r[None, None, None, :], r[None, None, :, None])
    return got, False


def _sdpa_mask(orig, causal):
    @functools.wraps(orig)
    def sdpa_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                  mask_function=causal, attention_mask=None, local_size=None,
                  allow_is_causal_skip=True, allow_is_bidirectional_skip=False, use_vmap=False,
                  device="cpu", **kwargs):
        import torch

        if (not ENABLED or getattr(device, "type", device) != "tpu" or use_vmap
                or mask_function is not causal or allow_is_causal_skip
                or allow_is_bidirectional_skip or type(kv_offset) is not int
                or torch.compiler.is_compiling()
                or (attention_mask is not None and (attention_mask.dim() != 2
                                                    or attention_mask.shape[0] != batch_size))):
            return orig(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                        mask_function=mask_function, attention_mask=attention_mask,
                        local_size=local_size, allow_is_causal_skip=allow_is_causal_skip,
                        allow_is_bidirectional_skip=allow_is_bidirectional_skip,
                        use_vmap=use_vmap, device=device, **kwargs)
        # transformers: and_masks(causal, padding)(b, h, q, kv) over broadcast aranges, i.e.
        # (kv <= q + q_offset) & padding_mask[b, kv] (a padding mask covers kv_offset + kv_length
        # positions once prepare_padding_mask padded it)
        padding_mask = _KNOWN["prepare_padding_mask"](attention_mask, kv_length, kv_offset)
        (kv, _), kv_made = _positions(kv_length, kv_offset, device)
        if (q_length == 1 and isinstance(q_offset, torch.Tensor) and q_offset.dim() == 0
                and not q_offset.dtype.is_floating_point and not q_offset.is_complex()
                and q_offset.dtype != torch.bool):
            # one query (a decode token) at a 0-d integer offset (a static cache's
            # cumulative_length): arange(1) + q_offset holds q_offset, its [1, 1, 1, 1]
            # broadcast against kv's [1, 1, 1, kv] gives kv's shape, and the integer types
            # promote alike, so the offset add is left out too
            mask = kv <= q_offset
            saved = 4 + 2 * kv_made  # batch, head and query aranges, the query offset add
        else:
            (_, q), q_made = _positions(q_length, 0, device)
            mask = kv <= q + q_offset
            # programs left out: the batch and head aranges, and those made once
            saved = 2 + 2 * kv_made + q_made
        if padding_mask is not None:
            # and_masks' new_ones and its AND with the causal part, the index
            mask = mask & padding_mask[:, None, None, kv_offset:kv_offset + kv_length]
            saved += 3
        _saved("sdpa_mask", saved)
        return mask.expand(batch_size, -1, q_length, kv_length)

    return sdpa_mask


def _patch_masks(mod) -> None:
    causal = getattr(mod, "causal_mask_function", None)
    interface = getattr(mod, "AttentionMaskInterface", None)
    if causal is None or interface is None or getattr(mod, "prepare_padding_mask", None) is None:
        from .hooks import skipped

        skipped(f"{mod.__name__}.sdpa_mask", "no causal_mask_function, AttentionMaskInterface "
                "or prepare_padding_mask")
        return
    _KNOWN["prepare_padding_mask"] = mod.prepare_padding_mask
    orig = mod.sdpa_mask
    if not patch(mod, "sdpa_mask", functools.partial(_sdpa_mask, causal=causal),
                 params=("batch_size", "q_length", "kv_length", "q_offset", "kv_offset",
                         "mask_function", "attention_mask", "allow_is_causal_skip",
                         "allow_is_bidirectional_skip", "use_vmap", "device"),
                 rebind=("transformers",)):
        return
    mapping = getattr(interface, "_global_mapping", None)
    if isinstance(mapping, dict) and mapping.get("sdpa") is orig:  # not a user's own
        mapping["sdpa"] = mod.sdpa_mask


_STEPS: dict = {}  # (n, rank, dtype, device) -> arange(n, dtype).view(1, ..., n) + 1


def _next_positions(position_ids, n: int):
    """``arange(n).view(1, ..., n) + position_ids[..., -1:] + 1`` as transformers computes it,
    for an integer ``position_ids``: ``position_ids[..., -1:] + (arange(n) + 1)``, the second
    term made once per length, rank, dtype and device (integer addition is associative and
    commutative, wrap-around included, so the values are the same bit for bit; the shape and
    dtype are the broadcast's). One program instead of three (arange and two adds)."""
    import torch

    key = (n, position_ids.dim(), position_ids.dtype, position_ids.device)
    step = _STEPS.get(key)
    made = step is not None
    if not made:
        if len(_STEPS) > 256:
            _STEPS.clear()
        required_dim = [1] * (position_ids.dim() - 1) + [-1]
        step = _STEPS[key] = torch.arange(
            n, dtype=position_ids.dtype, device=position_ids.device).view(*required_dim) + 1
    if made:
        _saved("position_ids", 2)
    return position_ids[..., -1:] + step


def _update_kwargs(orig):
    @functools.wraps(orig)
    def _update_model_kwargs_for_generation(self, outputs, model_kwargs,
                                            is_encoder_decoder=False, num_new_tokens=1):
        import torch

        key = "position_ids" if not is_encoder_decoder else "decoder_position_ids"
        position_ids = model_kwargs.get(key)
        if (not _on_tpu(position_ids) or type(num_new_tokens) is not int
                or num_new_tokens < 1 or position_ids.dim() < 1
                or position_ids.dtype == torch.bool or position_ids.dtype.is_floating_point
                or position_ids.is_complex()):
            return orig(self, outputs, model_kwargs, is_encoder_decoder=is_encoder_decoder,
                        num_new_tokens=num_new_tokens)
        # transformers' own update with the position ids left out (None: it skips them; the key
        # keeps its place in the dict), then theirs: cat([position_ids, next], -1)
        model_kwargs[key] = None
        try:
            out = orig(self, outputs, model_kwargs, is_encoder_decoder=is_encoder_decoder,
                       num_new_tokens=num_new_tokens)
        except BaseException:
            model_kwargs[key] = position_ids
            raise
        step = _next_positions(position_ids, num_new_tokens)
        out[key] = full = torch.cat([position_ids, step], dim=-1)
        # prepare_inputs_for_generation takes full[..., -n:].clone(): step holds those values,
        # a fresh contiguous tensor no one else holds; handed to it once (prepare_positions)
        full.__dict__["_torchtpu_next"] = (step, full._version, step._version)
        return out

    return _update_model_kwargs_for_generation


def _prepare_inputs(orig):
    @functools.wraps(orig)
    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, *args,
                                      **kwargs):
        key = "decoder_position_ids" if getattr(getattr(self, "config", None),
                                                "is_encoder_decoder", False) else "position_ids"
        full = kwargs.get(key)
        held = getattr(full, "__dict__", {}).pop("_torchtpu_next", None)
        if (held is not None and ENABLED and not args and type(next_sequence_length) is int
                and next_sequence_length == held[0].shape[-1]
                and input_ids.shape[-1] >= next_sequence_length
                and held[1] == full._version and held[2] == held[0]._version
                and not (kwargs.get("inputs_embeds") is not None
                         and kwargs.get("is_first_iteration"))):
            # transformers slices full[..., -n:] and clones it (contiguous): the step made
            # those values fresh, already of length n, so it is taken as it is
            kwargs[key] = held[0]
            _saved("position_ids", 1)
        return orig(self, input_ids, next_sequence_length, *args, **kwargs)

    return prepare_inputs_for_generation


def _patch_generation(mod) -> None:
    patch(mod, "GenerationMixin._update_model_kwargs_for_generation", _update_kwargs,
          params=("outputs", "model_kwargs", "is_encoder_decoder", "num_new_tokens"))
    patch(mod, "GenerationMixin.prepare_inputs_for_generation", _prepare_inputs,
          params=("input_ids", "next_sequence_length"))


def install() -> None:
    from .hooks import when_imported

    when_imported("transformers.masking_utils", _patch_masks)
    when_imported("transformers.generation.logits_process", _patch_logits)
    when_imported("transformers.generation.stopping_criteria", _patch_stopping)
    when_imported("transformers.generation.utils", _patch_generation)
