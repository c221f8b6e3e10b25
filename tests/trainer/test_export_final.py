"""After a run that saves checkpoints, the final actor is exported as a Hugging Face folder that
`AutoModelForCausalLM.from_pretrained` loads and that generates what the trained actor generates."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers.tiny_run import one_thread, tiny_model_dir, tiny_trainer


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def test_final_actor_export_generates_like_the_trained_actor(tmp_path):
    trainer = tiny_trainer(tmp_path, ["trainer.save_freq=2", "trainer.total_training_steps=2"])
    # a reward that varies within groups, so the policy-gradient updates really move the weights
    trainer.reward_fn = lambda batch: (batch["responses"][:, 0] % 2 == 0).float()
    history = trainer.fit()
    assert [row["step"] for row in history] == [1, 2]
    assert any(abs(row["actor/pg_loss"]) > 0 or row["actor/grad_norm"] > 0 for row in history)
    out = tmp_path / "ckpt" / "hf_model"
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()

    exported = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    actor = trainer.workers.actor.module.eval()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir(tmp_path), torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.get_vocab() == trainer.tokenizer.get_vocab()

    # the export holds the trained weights (step 2), not the initial ones
    trained = actor.state_dict()
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, trained[name].cpu()), name
    moved = max((p.cpu() - initial.state_dict()[n]).abs().max().item() for n, p in trained.items())
    assert moved > 1e-4, moved  # Adam moved them (the amount depends on the sampled responses)

    prompts = ["What is 3 + 4?", "What is 9 + 1?", "hello 2*3="]
    for text in prompts:
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id,
                      attention_mask=torch.ones_like(ids))
        with torch.no_grad():
            got = exported.generate(ids, **kwargs)
            want = actor.generate(ids.to(next(actor.parameters()).device), **kwargs).cpu()
            assert torch.allclose(exported(ids).logits, actor(ids.to(next(actor.parameters()).device)).logits.cpu(),
                                  atol=1e-5)
        assert got.shape[1] > ids.shape[1]
        assert torch.equal(got, want), (text, got.tolist(), want.tolist())
