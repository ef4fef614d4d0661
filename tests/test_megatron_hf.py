"""Megatron TP2 ↔ transformers' LlamaForCausalLM through one checkpoint format: a Megatron checkpoint
loads into the HF model (single process) with the same logits, and an HF checkpoint loads into
Megatron TP2 with the same logits. The vocabulary is padded on the Megatron side (94 real tokens,
96 rows): padding is not stored and is zero after a load."""
import os

import torch

import ckpt_plugins as cp
from distributed import run_ranks

VOCAB, PADDED = 94, 96
IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))


def hf_llama(seed):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # HF initialises norms to ones: make them count
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape))
    return model.eval()


def tp2_worker(rank, world, root):
    import megatron_util as mu
    from megatron_ext import MegatronModel
    mu.init_parallel(2, 1)
    model = mu.build_gpt(3, vocab=PADDED, distributed_optimizer=False)
    out = {"megatron": mu.logits(model, IDS)}
    cp.save(os.path.join(root, "megatron"), {"model": MegatronModel(model, vocab_size=VOCAB)})

    fresh = mu.build_gpt(4, vocab=PADDED, distributed_optimizer=False)
    cp.load(os.path.join(root, "hf"), {"model": MegatronModel(fresh, vocab_size=VOCAB)})
    gpt = mu.unwrap(fresh)
    for weight in (gpt.embedding.word_embeddings.weight, gpt.output_layer.weight):
        if rank == 1:  # rows 47, 48 of this rank's 48 are vocabulary padding
            assert torch.count_nonzero(weight[VOCAB - 48:]) == 0 and torch.count_nonzero(weight[:VOCAB - 48]) > 0
    out["from_hf"] = mu.logits(fresh, IDS)
    if rank == 0:
        torch.save(out, os.path.join(root, "logits.pt"))
    mu.destroy()


def test_megatron_tp2_and_hf_llama_load_each_other_with_the_same_logits(tmp_path):
    hf = hf_llama(0)
    cp.save(str(tmp_path / "hf"), {"model": hf})
    run_ranks(2, tp2_worker, str(tmp_path))
    logits = torch.load(tmp_path / "logits.pt")

    loaded = hf_llama(1)
    cp.load(str(tmp_path / "megatron"), {"model": loaded})
    with torch.no_grad():
        ours = loaded(IDS).logits
        ref = hf(IDS).logits
    # same weights, same function: only the summation order of the TP-split matmuls differs
    torch.testing.assert_close(ours, logits["megatron"][..., :VOCAB], rtol=0, atol=2e-5)
    torch.testing.assert_close(logits["from_hf"][..., :VOCAB], ref, rtol=0, atol=2e-5)
    assert not torch.allclose(ours, ref, atol=1e-3)  # two different models, not one default init
