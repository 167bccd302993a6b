"""The roofline floor counts what a call must move and compute, no more: a candidate faster than it
is refused as impossible, so a floor too high refuses honest kernels (on an H100, every
cache_attention candidate faster than 0.34 ms on Llama's decode was, its floor counting both
layers' caches), and the report's fraction of it would flatter every way."""

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

from tools import roofline
from tools.modelfile import tensors_in

aten = torch.ops.aten
SET = Path(__file__).resolve().parent / "problems"


def _moved(call, tracked) -> int:
    notes = []
    moved, _ = roofline.measure(call, tracked, notes)
    assert moved is not None, notes
    return moved


def test_a_table_looked_up_counts_the_rows_read_not_the_table():
    table = torch.randn(1000, 64)
    ids = torch.tensor([3, 7, 7, 900])
    moved = _moved(lambda: torch.nn.functional.embedding(ids, table), [table, ids])
    assert moved == 4 * 64 * 4 + ids.numel() * 8


def test_one_layer_of_a_cache_holding_every_layer_counts_that_layer():
    cache = torch.randn(2, 4, 128, 16)  # [layer, heads, positions, dim]
    q = torch.randn(4, 1, 16)
    one = _moved(lambda: q @ cache[0].transpose(-1, -2), [cache])
    assert one == cache[0].numel() * 4
    both = _moved(lambda: (q @ cache[0].transpose(-1, -2), q @ cache[1].transpose(-1, -2)), [cache])
    assert both == cache.numel() * 4
    untouched = torch.randn(64, 64)
    assert _moved(lambda: q * 2, [untouched]) == 0


def test_a_scatter_into_a_buffer_counts_the_values_written_until_the_buffer_is_read():
    buf = torch.zeros(4, 256, 16)
    new = torch.randn(4, 1, 16)
    pos = torch.tensor([5])
    assert _moved(lambda: buf.index_copy_(1, pos, new), [buf]) == new.numel() * 4

    def write_then_read():
        buf.index_copy_(1, pos, new)
        return buf.sum()
    assert _moved(write_then_read, [buf]) == buf.numel() * 4


def test_attention_flops_count_each_query_head_of_a_group_and_skip_what_the_mask_or_causality_does():
    """torch's own formula asserts on grouped-query shapes (32 query heads over 8 KV heads on the
    H100: the floor fell back to bytes only, 0.39 ms for a prefill that needs 2.2 ms of FLOPs)."""
    f = roofline.attention_formulas()
    q, kv = torch.randn(1, 8, 16, 32), torch.randn(1, 2, 16, 32)
    full = 2 * 8 * 16 * 16 * (32 + 32)
    efficient, flash = f[aten._scaled_dot_product_efficient_attention], f[aten._scaled_dot_product_flash_attention]
    assert efficient(q, kv, kv, None, False) == full
    assert flash(q, kv, kv, 0.0, True) == full // 2
    half = torch.zeros(1, 1, 16, 16)
    half[..., 8:] = -float("inf")
    assert efficient(q, kv, kv, half, False) == full // 2
    allowed = torch.ones(1, 1, 16, 16, dtype=torch.bool)
    allowed[..., 12:] = False
    assert efficient(q, kv, kv, allowed, False) == full * 3 // 4


def _hf_llama():
    spec = importlib.util.spec_from_file_location("hf_llama_small", SET / "hf_llama.py")
    m = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec.loader.exec_module(m)
        return m, m.Model()


def test_a_served_models_floor_reads_its_weights_its_cache_and_the_embedding_rows_it_looks_up():
    m, model = _hf_llama()
    inputs = m.get_workloads()["decode"]["inputs"]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.model.embed_tokens.weight
    cache = sum(t.numel() * t.element_size() for t in inputs[1:3])
    notes = []
    moved, flops = roofline.measure(lambda: model(*inputs), [*tensors_in(inputs), *model.parameters()], notes)
    assert flops and not notes, notes
    rows = inputs[0].numel() * table.shape[1] * table.element_size()
    needed = params - table.numel() * table.element_size() + cache + rows
    assert needed <= moved < needed + inputs[0].numel() * 8 + 1024  # + the ids and scalars


def test_a_frozen_attention_layers_floor_counts_its_own_layer_of_the_cache(tmp_path):
    """The layer's frozen cache holds both layers' keys and values; its decode reads one layer's."""
    from tools.capture import RegionChoice, freeze
    from tools.modelfile import load_model
    ceilings = {"bandwidth_gbps": 1.0, "matmul_tflops": 1e9}  # 1 GB/s: the floor in ms is bytes / 1e6
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        frozen, skipped = freeze(load_model(SET / "hf_llama.py", "cpu"), [RegionChoice("LlamaAttention")],
                                 tmp_path / "p", torch.device("cpu"), ceilings=ceilings)
    assert not skipped, skipped
    m, model = _hf_llama()
    attn = model.model.layers[0].self_attn
    weights = sum(p.numel() * p.element_size() for p in attn.parameters())
    batch, kv_heads, dim = 4, m.KV_HEADS, m.HEAD_DIM
    layer_cache = 2 * batch * kv_heads * 32 * dim * 4  # keys and values of one layer, 32 positions, fp32
    moved = frozen[0].floor_ms["decode"] * 1e6
    assert weights + layer_cache <= moved < weights + 2 * layer_cache, (moved, weights, layer_cache)
