"""data.position_ids=per_document across model families: raytrain.model.PER_DOCUMENT_MODEL_TYPES is the list of
model types for which each document's tokens attend to that document alone, with the inputs the worker gives
(raytrain.worker.engine.model_inputs): the rows under SDPA (eager where the class has no SDPA), whose 4D document
mask transformers builds from the positions, and one row under a CPU stand-in for flash attention that does what
transformers' flash path does (the varlen arguments when they reach the layer, else bounds found from the positions
of one row, else causal attention over everything). Each document's logits must equal the document's run alone.
The types left out fail that way (OPT: its mask ignores the positions; Jamba: its Mamba layers run along the row),
and the driver refuses them (raytrain.planning.resolve). Tiny random models, no download: ~0.1 s a type."""

import pytest
import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
from transformers.modeling_flash_attention_utils import _is_packed_sequence

from raytrain.config import ConfigError, load_config
from raytrain.model import PER_DOCUMENT_MODEL_TYPES
from raytrain.planning.resolve import resolve_run, shape_from_config
from raytrain.worker.engine import model_inputs
from tests.helpers import attention_within

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=128, head_dim=16, n_embd=64, n_layer=2, n_head=4, n_positions=128,
             ffn_dim=96, moe_intermediate_size=32, num_experts=4, num_local_experts=4, num_experts_per_tok=2,
             shared_expert_intermediate_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False, partial_rotary_factor=1.0, rotary_dim=16, use_cache=False,
             attn_logit_softcapping=None, final_logit_softcapping=None)
PATHS: list[str] = []  # how the stand-in found the documents, one entry per attention layer and call


def flash_path_on_cpu(module, query, key, value, attention_mask, scaling=None, dropout=0.0, position_ids=None,
                      **kwargs):
    """transformers' _flash_attention_forward's choice of bounds, then causal attention within each document
    (query: batch 1, heads, tokens, head_dim). The mask is ignored, as flash attention ignores a 4D mask."""
    if kwargs.get("cu_seq_lens_q") is not None:
        cu, path = kwargs["cu_seq_lens_q"].tolist(), "bounds"
    elif _is_packed_sequence(position_ids, query.shape[0]):  # a decoder layer that drops the varlen arguments
        cu, path = (position_ids.reshape(-1) == 0).nonzero().view(-1).tolist() + [query.shape[2]], "positions"
    else:
        cu, path = [0, query.shape[2]], "none"
    PATHS.append(path)
    return attention_within(query, key, value, cu, scaling)


AttentionInterface.register("varlen_path_on_cpu", flash_path_on_cpu)


def tiny(model_type: str):
    default = AutoConfig.for_model(model_type)
    # only fields the type has, and not its read-only properties (Falcon's head_dim)
    small = {k: v for k, v in SMALL.items()
             if hasattr(default, k) and not isinstance(getattr(type(default), k, None), property)}
    config = AutoConfig.for_model(model_type, **small)  # derived lists (layer_types) follow num_hidden_layers
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    except ValueError:  # no SDPA for the class (Gemma2): eager, as "auto" resolves it
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.config.use_cache = False  # as raytrain.model.build_model leaves it: with a cache, no document mask
    return model.eval()


def worst_leak(model_type: str) -> tuple[float, float, set[str]]:
    """The largest difference between a document's logits in the micro-batch and alone: (rows, one row), and the
    stand-in's paths."""
    model = tiny(model_type)
    ids = torch.randint(3, 256, (3, 32), generator=torch.Generator().manual_seed(1))
    positions = torch.stack([torch.cat([torch.arange(12), torch.arange(20)]), torch.arange(32),
                             torch.cat([torch.arange(5), torch.arange(20), torch.arange(7)])])
    batch = {"input_ids": ids, "position_ids": positions}
    own = model.config._attn_implementation

    def logits(one_row: bool):
        inputs = model_inputs(batch, one_row=one_row)
        inputs.pop("labels")
        return model(**inputs).logits.reshape(3, 32, -1)

    with torch.no_grad():
        rows = logits(one_row=False)
        model.set_attn_implementation("varlen_path_on_cpu")
        PATHS.clear()
        one = logits(one_row=True)
        paths = set(PATHS)
        model.set_attn_implementation(own)
        leak_rows = leak_one = 0.0
        for row, pos in enumerate(positions.tolist()):
            starts = [i for i, p in enumerate(pos) if p == 0] + [32]
            for start, end in zip(starts, starts[1:]):
                alone = model(input_ids=ids[row:row + 1, start:end]).logits[0]
                leak_rows = max(leak_rows, (rows[row, start:end] - alone).abs().max().item())
                leak_one = max(leak_one, (one[row, start:end] - alone).abs().max().item())
    return leak_rows, leak_one, paths


@pytest.mark.parametrize("model_type", sorted(PER_DOCUMENT_MODEL_TYPES))
def test_each_document_sees_itself_alone(model_type):
    leak_rows, leak_one, paths = worst_leak(model_type)
    assert leak_rows < 1e-5 and leak_one < 1e-5, (leak_rows, leak_one)
    # every attention call found the documents (Falcon and StableLM drop the varlen arguments: from the positions)
    assert paths and "none" not in paths, paths


@pytest.mark.parametrize("model_type", ["opt", "jamba"])
def test_the_types_left_out_let_documents_see_each_other_and_are_refused(model_type, tmp_path):
    leak_rows, leak_one, _ = worst_leak(model_type)
    assert max(leak_rows, leak_one) > 1e-3  # OPT's rows (mask without positions); Jamba's Mamba layers, both forms
    assert model_type not in PER_DOCUMENT_MODEL_TYPES
    tiny(model_type).config.save_pretrained(tmp_path)
    cfg = load_config(None, [f"model.name_or_path={tmp_path}", "data.position_ids=per_document"])
    with pytest.raises(ConfigError, match=rf"^data.position_ids=per_document keeps .* this model is {model_type}, "
                                          rf".*: set data.position_ids=packed$"):
        resolve_run(cfg, shape_from_config(cfg))
    packed = load_config(None, [f"model.name_or_path={tmp_path}"])
    with pytest.raises(ConfigError) as e:  # packed positions pass this check (it fails later: no tokenizer there)
        resolve_run(packed, shape_from_config(packed))
    assert "position_ids" not in str(e.value)
