"""vLLM's shared-storage KV connector on "tpu" (prefill/decode disaggregation without RDMA).

vLLM's ``ExampleConnector`` (the shared-storage connector: a prefill instance writes each
prompt's KV, layer by layer, to ``safetensors`` files under ``shared_storage_path``; a decode
instance finds the prompt there and loads its KV into its own paged cache instead of computing
it) addresses a layer's cache as vLLM's standardized ``[blocks, heads, block_size, head_dim]``
view. This runner's cache is ``[blocks, block_size, 2 * kv_heads, head_dim]`` (attention.py),
so ``TpuExampleConnector`` is that connector with the two tensor accesses written for it: the
tokens of slot ``s`` are row ``s % block_size`` of block ``s // block_size``, i.e. a
``[tokens, 2 * kv_heads, head_dim]`` gather (saved) or ``index_put_`` (loaded), on the device.
Everything else (which requests to store or load, file names, the scheduler side) is vLLM's.
The files hold keys and values interleaved by head, this layout's order: a prefill and a decode
instance on "tpu" read each other's files.

The platform (platform.py) puts this class in place of ``ExampleConnector`` when
``--kv-transfer-config`` names it, so vLLM's own disaggregation recipe runs unchanged. The
runner (model_runner.py) calls ``save_kv_layer`` for every layer after the forward, outside
the compiled program (vLLM calls it from inside each attention layer, where a file write would
break the compiled graph).
"""
from __future__ import annotations

from typing import Any

import safetensors.torch
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

NAME = "TpuExampleConnector"
MODULE = __name__
# the vLLM connectors this module stands in for on "tpu" (SharedStorageConnector: its old name)
REPLACES = ("ExampleConnector", "SharedStorageConnector")


def _rows(slot_mapping: torch.Tensor, block_size: int, device):
    slots = slot_mapping.to(torch.int64)
    return (slots // block_size).to(device), (slots % block_size).to(device)


class TpuExampleConnector(ExampleConnector):
    """``ExampleConnector`` over the "tpu" runner's KV cache layout (module docstring)."""

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ExampleConnectorMetadata)
        if forward_context.attn_metadata is None:
            logger.warning("In connector.start_load_kv, but the attn_metadata is None")
            return
        for request in metadata.requests:
            if request.is_store:
                continue
            logger.info("Inject KV cache of %d tokens to the paged memory",
                        len(request.slot_mapping))
            for layer_name, layer in forward_context.no_compile_layers.items():
                kv = getattr(layer, "kv_cache", None)
                if not isinstance(kv, torch.Tensor):
                    continue
                filename = self._generate_filename_debug(layer_name, request.token_ids,
                                                         request.mm_hashes)
                src = safetensors.torch.load_file(filename)["kv_cache"]
                blocks, offsets = _rows(request.slot_mapping, self._block_size, kv.device)
                kv.index_put_((blocks, offsets), src.to(kv.device, kv.dtype))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata,
                      **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ExampleConnectorMetadata)
        for request in metadata.requests:
            if not request.is_store:
                continue
            filename = self._generate_filename_debug(layer_name, request.token_ids,
                                                     request.mm_hashes)
            blocks, offsets = _rows(request.slot_mapping, self._block_size, kv_layer.device)
            rows = kv_layer[blocks, offsets].cpu()  # [tokens, 2 * kv_heads, head_dim]
            safetensors.torch.save_file({"kv_cache": rows.contiguous()}, filename)


def replace_connector(kv_transfer_config) -> None:
    """Called by the platform: vLLM's shared-storage connector becomes ``TpuExampleConnector``
    (same extra config, same files); any other connector is left as the user named it."""
    if kv_transfer_config is None or kv_transfer_config.kv_connector not in REPLACES:
        return
    if kv_transfer_config.kv_connector_module_path:
        return  # the user's own class of that name
    logger.info("KV connector %s on tpu: %s.%s", kv_transfer_config.kv_connector, MODULE, NAME)
    kv_transfer_config.kv_connector = NAME
    kv_transfer_config.kv_connector_module_path = MODULE
