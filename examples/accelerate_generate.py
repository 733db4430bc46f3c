"""Data-parallel `LLM.generate` (and the paged pipeline) on several processes. The same prompts on every process: each
serves every world_size-th prompt and every process gets all outputs back, in input order. Different prompts per
process (accelerate's `split_between_processes`, even an uneven or empty share): each serves and returns its own.

Two CPU processes (gloo), either launcher:

    torchrun --standalone --nproc_per_node 2 examples/accelerate_generate.py
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \\
        examples/accelerate_generate.py

On a machine without GPUs `--multi_gpu` is what starts several processes (they run on CPU with gloo); add
`CUDA_VISIBLE_DEVICES=""` in front to keep CPU processes on a GPU machine. `accelerate launch --cpu
--num_processes 2` starts only ONE process: with `--cpu` accelerate uses its single-process launcher unless an MPI
hostfile (`--mpirun_hostfile`, with mpirun installed) is given. With GPUs, one process per GPU:

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_generate.py --device cuda
"""
import argparse

import torch
import torch.distributed as dist
from accelerate import PartialState

from hf_paged import LLM, SamplingParams
from hf_paged.tiny import tiny_chat_model

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cpu", help="cpu, or cuda (each process takes the GPU of its LOCAL_RANK)")
args = parser.parse_args()

started = not dist.is_initialized()
# cpu=True on CPU: without it accelerate starts the process group on a CPU host yet says "one process" (its
# split_between_processes then gives every process all prompts: hf_paged sees the same prompts and splits them)
state = PartialState(cpu=args.device == "cpu")
model, tok = tiny_chat_model()
if args.device == "cuda":
    model = model.to(state.device)
torch.set_num_threads(1)
llm = LLM(model, tok)  # detects the launcher; without num_blocks each process takes its share of the KV budget
params = SamplingParams(max_tokens=8, temperature=0.0)
prompts = [f"Prompt {k}: " + "xy" * k for k in range(7)]
outs = llm.generate(prompts, params, use_tqdm=False)  # the same prompts everywhere: split, all outputs everywhere
stats = llm.stats()
with state.split_between_processes(prompts) as mine:  # each process its own share: its own outputs, in its order
    own = llm.generate(mine, params, use_tqdm=False)
assert [out.prompt for out in own] == list(mine) and [out.prompt for out in outs] == prompts
print(f"rank {llm.world.rank}/{llm.world.size}: prefilled {stats['num_prompt_tokens']} prompt tokens, "
      f"got {len(outs)} outputs; first: {outs[0].text!r}; own share: {len(own)} outputs", flush=True)
if started:
    state.destroy_process_group()  # a gloo group left to the interpreter's teardown may abort the process at exit
