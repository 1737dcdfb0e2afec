"""Offline self-check of everything rl_loop / sl_loop do on the client side, with no server.

Run by setup_cookbook.sh (with HF_HOME=<cache>/hf HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1) in the cookbook
venv: the same tokenizer, renderer and dataset calls as the loops, then the datums they build from
fake server outputs (sl_loop: conversation_to_datum + compute_mean_nll/compute_bpb; rl_loop:
parse_response + get_reward + the stable_reinforce provenance spans), and the data the DPO and
on-policy distillation recipes load.
"""

import sys

import datasets
import torch
from tinker import types
from tinker.types.tensor_data import TensorData
from tinker_cookbook import model_info, renderers
from tinker_cookbook.distillation.datasets import load_deepmath_prompts
from tinker_cookbook.recipes.preference.datasets import HHHComparisonBuilder
from tinker_cookbook.recipes.rl_loop import get_reward, with_sampled_provenance
from tinker_cookbook.supervised.common import compute_bpb, compute_mean_nll
from tinker_cookbook.supervised.data import conversation_to_datum
from tinker_cookbook.tokenizer_utils import get_tokenizer

model_name = sys.argv[1]
tok = get_tokenizer(model_name)
renderer_name = model_info.get_recommended_renderer_name(model_name)
renderer = renderers.get_renderer(renderer_name, tok)
stop = renderer.get_stop_sequences()
print(
    f"model_name={model_name} renderer={renderer_name} stop={stop} vocab={len(tok)} eos={tok.eos_token_id}"
)

# sl_loop's data path
sl = datasets.load_dataset("HuggingFaceH4/no_robots")
assert isinstance(sl, datasets.DatasetDict)
rows = sl["train"].shuffle(seed=0).select(range(4))
batch = [
    conversation_to_datum(
        row["messages"], renderer, 512, renderers.TrainOnWhat.ALL_ASSISTANT_MESSAGES
    )
    for row in rows
]
fake_logprobs = [TensorData.from_torch(torch.full((d.model_input.length,), -2.0)) for d in batch]
weights = [d.loss_fn_inputs["weights"] for d in batch]
targets = [d.loss_fn_inputs["target_tokens"] for d in batch]
nll, bpb = (
    compute_mean_nll(fake_logprobs, weights),
    compute_bpb(fake_logprobs, weights, targets, tok),
)
print(
    f"sl_loop: no_robots stand-in {sl.num_rows}; datum lengths {[d.model_input.length for d in batch]}; nll={nll:.2f}"
)

# rl_loop's data path
rl = datasets.load_dataset("openai/gsm8k", "main")
assert isinstance(rl, datasets.DatasetDict)
question, answer = rl["train"][0]["question"], rl["train"][0]["answer"]
prompt = renderer.build_generation_prompt([{"role": "user", "content": question}])
final = answer.split("####")[-1].strip()
sampled = tok.encode(f"So \\boxed{{{final}}}", add_special_tokens=False) + [tok.eos_token_id]
message, termination = renderer.parse_response(sampled)
reward = get_reward(renderers.get_text_content(message), answer)
assert reward == 1.0, (message, termination)
ob_len = prompt.length - 1
model_input = prompt.append(types.EncodedTextChunk(tokens=sampled[:-1]))
datum = types.Datum(
    model_input=model_input,
    loss_fn_inputs={
        "target_tokens": TensorData.from_torch(torch.tensor([0] * ob_len + sampled)),
        "logprobs": TensorData.from_torch(torch.tensor([0.0] * (ob_len + len(sampled)))),
        "advantages": TensorData.from_torch(torch.tensor([0.0] * ob_len + [1.0] * len(sampled))),
    },
)
with_sampled_provenance(datum, prompt.length, len(sampled), "seq-0")
print(
    f"rl_loop: gsm8k {rl.num_rows}; prompt {prompt.length} tokens; parse={termination.value} reward={reward}"
)

# The DPO recipe's hhh comparisons and on-policy distillation's deepmath prompts (stand-ins)
hhh_train, hhh_test = HHHComparisonBuilder().get_train_and_test_datasets()
comparison = HHHComparisonBuilder().example_to_labeled_comparison(hhh_train[0])
assert comparison is not None, hhh_train[0]
deepmath = load_deepmath_prompts("train")
assert deepmath, "no deepmath prompts"
print(
    f"dpo: hh-rlhf stand-in {len(hhh_train)} train pairs; distillation: {len(deepmath)} deepmath prompts"
)
print("offline check passed")
