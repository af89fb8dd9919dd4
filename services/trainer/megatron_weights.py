"""Full Hugging Face tensors from the shards of a megatron model spread over TP x PP ranks, gathered on the
trainer's leader (global rank 0) for publishing: a collective every rank joins.

Data-parallel replica 0's ranks send their shards to the leader in name order, one tensor at a time, over
point-to-point messages of the trainer's process group (tensors only: nothing is pickled); the leader knows
every shard's names and shapes by converting a shape-only (meta) copy of the HF state with the same layout
(services/trainer/megatron_model.py: to_megatron) and merges them back (to_hf)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from services.trainer.megatron_model import to_hf, to_megatron


class ShardGather:
    def __init__(self, ddp_model, hf_config, hf_state: dict, dp, tp: int, pp: int):
        from megatron.core import parallel_state as ps

        self.module, self.hf_config, self.dp, self.tp, self.pp = ddp_model.module, hf_config, dp, tp, pp
        self.meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in hf_state.items()}
        tied = bool(hf_config.tie_word_embeddings)
        self.names = [k for k in hf_state if not (tied and k == "lm_head.weight")]
        me = torch.tensor([ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                           ps.get_data_parallel_rank()], dtype=torch.int64)
        table = [torch.zeros(3, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(table, me)
        self.source = {(int(s), int(r)): rank for rank, (s, r, d) in enumerate(t.tolist() for t in table) if d == 0}
        self.position, self.data_rank = (int(me[0]), int(me[1])), int(me[2])

    def _local(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.module.state_dict().items() if not k.endswith("_extra_state")}

    def gather(self) -> list[tuple[str, torch.Tensor]] | None:
        """(HF name, full tensor) on the leader, None on the other ranks."""
        if not self.dp.is_leader:
            if self.data_rank == 0:
                local = self._local()
                for name in sorted(local):
                    dist.send(local[name].contiguous(), dst=0)
            return None
        stages = [[{} for _ in range(self.tp)] for _ in range(self.pp)]
        for (stage, rank_in_tp), source in sorted(self.source.items(), key=lambda item: item[1]):
            if source == dist.get_rank():
                stages[stage][rank_in_tp] = {k: v.clone() for k, v in self._local().items()}
                continue
            shapes = to_megatron(self.meta, self.hf_config, self.tp, rank_in_tp, self.pp, stage)
            for name in sorted(shapes):
                received = torch.empty(shapes[name].shape, dtype=shapes[name].dtype)
                dist.recv(received, src=source)
                stages[stage][rank_in_tp][name] = received
        full = to_hf(stages, self.hf_config)
        return [(name, full[name]) for name in self.names]
