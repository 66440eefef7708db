"""Fused LSTM/GRU cells: what nn.LSTM/GRU/LSTMCell/GRUCell dispatch to on an accelerator.

The workspace (activated gates) only has to agree between our own forward and backward.
Gate order as PyTorch: LSTM (input, forget, cell, output); GRU (reset, update, new).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .registry import aten, register


def _add_biases(ig, hg, ib, hb):
    if ib is not None:
        ig = ig + ib
    if hb is not None:
        hg = hg + hb
    return ig, hg


@register(aten._thnn_fused_lstm_cell.default)
def fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    ig, hg = _add_biases(input_gates, hidden_gates, input_bias, hidden_bias)
    i, f, g, o = jnp.split(ig + hg, 4, axis=1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * cx + i * g
    hy = o * jnp.tanh(cy)
    return hy, cy, jnp.concatenate([i, f, g, o], axis=1)


@register(aten._thnn_fused_lstm_cell_backward_impl.default)
def fused_lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    i, f, g, o = jnp.split(workspace, 4, axis=1)
    t = jnp.tanh(cy)
    d_hy = jnp.zeros_like(cy) if grad_hy is None else grad_hy
    d_cy = d_hy * o * (1 - t * t)
    if grad_cy is not None:
        d_cy = d_cy + grad_cy
    gates = jnp.concatenate([d_cy * g * i * (1 - i), d_cy * cx * f * (1 - f),
                             d_cy * i * (1 - g * g), d_hy * t * o * (1 - o)], axis=1)
    grad_bias = gates.sum(0) if has_bias else jnp.zeros(gates.shape[1:], gates.dtype)
    return gates, d_cy * f, grad_bias


@register(aten._thnn_fused_gru_cell.default)
def fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    ig, hg = _add_biases(input_gates, hidden_gates, input_bias, hidden_bias)
    ir, iz, in_ = jnp.split(ig, 3, axis=1)
    hr, hz, hn = jnp.split(hg, 3, axis=1)
    r = jax.nn.sigmoid(ir + hr)
    z = jax.nn.sigmoid(iz + hz)
    n = jnp.tanh(in_ + r * hn)
    hy = (1 - z) * n + z * hx
    return hy, jnp.concatenate([r, z, n, hx, hn], axis=1)


@register(aten._thnn_fused_gru_cell_backward.default)
def fused_gru_cell_backward(grad_hy, workspace, has_bias):
    r, z, n, hx, hn = jnp.split(workspace, 5, axis=1)
    d_n = grad_hy * (1 - z) * (1 - n * n)
    d_z = grad_hy * (hx - n) * z * (1 - z)
    d_r = d_n * hn * r * (1 - r)
    grad_input = jnp.concatenate([d_r, d_z, d_n], axis=1)
    grad_hidden = jnp.concatenate([d_r, d_z, d_n * r], axis=1)
    grad_hx = grad_hy * z
    if has_bias:
        bi, bh = grad_input.sum(0), grad_hidden.sum(0)
    else:
        bi = bh = jnp.zeros(grad_input.shape[1:], grad_input.dtype)
    return grad_input, grad_hidden, grad_hx, bi, bh
