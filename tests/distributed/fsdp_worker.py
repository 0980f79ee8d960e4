"""One rank of tests/distributed/test_fsdp.py: the MARS loss under FSDP2, as configs/accelerate/fsdp.yaml
shards a model (each decoder layer, then the root), on gloo.

Each rank takes its half of the batch and divides by the targets of the whole batch, as the
trainer does (trainer.MarsTrainer); FSDP sums the gradients. Rank 0 then compares the full
gradients with one process's on the whole batch, gathers the full state dict and saves it.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, Qwen2Config

from marslm.training.collate import collate
from marslm.training.objective import LossOptions, mars_loss, normalizer
from tests.helpers import TINY_SIZES

out = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
config = Qwen2Config(vocab_size=128, **TINY_SIZES)
model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
single = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
single.load_state_dict(model.state_dict())
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)

generator = torch.Generator().manual_seed(1)
examples = []
for n in (9, 12, 14, 7):
    ids = torch.randint(4, 128, (n,), generator=generator).tolist()
    examples.append({"input_ids": ids, "labels": [-100] * 4 + ids[4:]})
batch = collate(examples, pad_id=0, block_size=4, eos_id=2)
denominator = float(normalizer(batch["labels"], None, "sequence"))
mine = slice(rank * 2, rank * 2 + 2)
loss = mars_loss(model, batch["input_ids"][mine], batch["labels"][mine], LossOptions(4, 3), denominator=denominator)[
    "loss"
]
(loss * world).backward()  # FSDP averages over ranks; the denominator already counts the whole batch
whole = mars_loss(single, batch["input_ids"], batch["labels"], LossOptions(4, 3))["loss"]
whole.backward()

grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
total = torch.tensor([float(loss)])
dist.all_reduce(total)
if rank == 0:
    single.load_state_dict(state)  # the gathered state dict is a whole model's
    single.save_pretrained(out)
    worst = max(float((grads[name] - p.grad).abs().max()) for name, p in single.named_parameters())
    print(json.dumps({"loss": float(total), "single_loss": float(whole), "max_grad_diff": worst}), flush=True)
dist.destroy_process_group()
