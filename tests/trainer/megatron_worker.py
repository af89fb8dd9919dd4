"""One rank of a megatron-core model on CPU for test_megatron_cpu: build this rank's GPTModel from an HF
config (tensor and pipeline parallel over gloo), load its shard of the HF weights, run a forward pass and (the
last stage's tensor rank 0) save the full-vocabulary logits."""

import argparse
import os
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message="Apex is not installed")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model"), p.add_argument("--master"), p.add_argument("--out")
    for flag in ("--rank", "--tp", "--pp"):
        p.add_argument(flag, type=int)
    a = p.parse_args()
    torch.set_num_threads(1)
    from services.trainer.megatron_cpu import install
    install()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from services.trainer.megatron_model import build_gpt, init_model_parallel, to_megatron

    world = a.tp * a.pp
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}", rank=a.rank, world_size=world)
    init_model_parallel(a.tp, a.pp, seed=0)
    stage, tp_rank = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    first, last = stage == 0, stage == a.pp - 1
    config = AutoConfig.from_pretrained(a.model)
    model = build_gpt(config, a.tp, a.pp, pre_process=first, post_process=last)
    shard = to_megatron(load_file(os.path.join(a.model, "model.safetensors")), config, a.tp, tp_rank, a.pp, stage)
    missing, unexpected = model.load_state_dict(shard, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    ids = torch.load(os.path.join(os.path.dirname(a.out), "ids.pt"))
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.no_grad():
        if not first:  # the previous stage's hidden states, [seq, batch, hidden]
            hidden = torch.empty(ids.shape[1], ids.shape[0], config.hidden_size)
            dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(input_ids=ids, position_ids=positions, attention_mask=None)
        if not last:
            dist.send(out.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
        else:
            logits = gather_from_tensor_model_parallel_region(out)
            if tp_rank == 0:
                save_file({"logits": logits.contiguous()}, a.out)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
