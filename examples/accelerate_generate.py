"""Data-parallel `LLM.generate` (and the paged pipeline) on several processes: each process serves every
world_size-th prompt and every process gets all outputs back, in input order.

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

from hf_paged import LLM, SamplingParams
from hf_paged.tiny import tiny_chat_model

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cpu", help="cpu, or cuda (each process takes the GPU of its LOCAL_RANK)")
args = parser.parse_args()

model, tok = tiny_chat_model()
if args.device == "cuda":
    from accelerate import PartialState

    model = model.to(PartialState().device)
torch.set_num_threads(1)
llm = LLM(model, tok)  # detects the launcher; without num_blocks each process takes its share of the KV budget
prompts = [f"Prompt {k}: " + "xy" * k for k in range(8)]
outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
stats = llm.stats()
print(f"rank {llm.world.rank}/{llm.world.size}: prefilled {stats['num_prompt_tokens']} prompt tokens, "
      f"got {len(outs)} outputs; first: {outs[0].text!r}", flush=True)
