"""Full Hugging Face tensors from the shards of a megatron model spread over TP x PP ranks, made on the
trainer's leader (global rank 0) one layer at a time: a collective every rank joins.

The weights travel in units, in the order of the HF names: the embedding, each decoder layer, then the final
norm and output layer. For each unit, the ranks of data-parallel replica 0 that hold part of it (every
tensor-parallel rank of its pipeline stage) send their tensors of it to the leader in name order, over
point-to-point messages of the trainer's process group (tensors only: nothing is pickled). The leader knows
every shard's names and shapes by converting a shape-only (meta) copy of the HF state with the same layout
(services/trainer/megatron_model.py: to_megatron) and merges each unit back into HF tensors as it arrives, so
a publish (a WeightStream, services/trainer/weight_stream.py) holds about one layer beyond its buckets."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from services.trainer.megatron_model import ends_to_hf, layer_to_hf, to_megatron

Unit = tuple[int, Callable[[str], bool], Callable[[list], dict]]  # stage, which megatron keys, to HF tensors


class ShardGather:
    def __init__(self, ddp_model, hf_config, hf_state: dict, dp, tp: int, pp: int):
        from megatron.core import parallel_state as ps

        self.module, self.hf_config, self.dp, self.tp, self.pp = ddp_model.module, hf_config, dp, tp, pp
        self.meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in hf_state.items()}
        tied = bool(hf_config.tie_word_embeddings)
        self.names = [k for k in hf_state if not (tied and k == "lm_head.weight")]
        me = torch.tensor(
            [ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()],
            dtype=torch.int64,
        )
        table = [torch.zeros(3, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(table, me)
        self.source = {(int(s), int(r)): rank for rank, (s, r, d) in enumerate(t.tolist() for t in table) if d == 0}
        self.position, self.data_rank = (int(me[0]), int(me[1])), int(me[2])
        self._shapes: dict[tuple[int, int], dict] = {}

    def units(self) -> list[Unit]:
        cfg, per = self.hf_config, self.hf_config.num_hidden_layers // self.pp
        ends = {"decoder.final_layernorm.weight", "output_layer.weight"}
        units: list[Unit] = [
            (0, lambda k: k == "embedding.word_embeddings.weight", lambda shards: ends_to_hf(shards, cfg, True, False))
        ]
        for layer in range(cfg.num_hidden_layers):
            prefix = f"decoder.layers.{layer % per}."
            units.append(
                (
                    layer // per,
                    lambda k, prefix=prefix: k.startswith(prefix),  # type: ignore[misc]
                    lambda shards, layer=layer: layer_to_hf(shards, cfg, layer % per, layer),  # type: ignore[misc]
                )
            )
        units.append((self.pp - 1, lambda k: k in ends, lambda shards: ends_to_hf(shards, cfg, False, True)))
        return units

    def unit_of(self, hf_name: str) -> int:
        if hf_name == "model.embed_tokens.weight":
            return 0
        if hf_name.startswith("model.layers."):
            return 1 + int(hf_name.split(".")[2])
        return 1 + self.hf_config.num_hidden_layers

    def local(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.module.state_dict().items() if not k.endswith("_extra_state")}

    def shapes(self, stage: int, rank_in_tp: int) -> dict:
        if (stage, rank_in_tp) not in self._shapes:
            self._shapes[stage, rank_in_tp] = to_megatron(
                self.meta, self.hf_config, self.tp, rank_in_tp, self.pp, stage
            )
        return self._shapes[stage, rank_in_tp]


class ShardStream:
    """The full weights as a WeightStream: on the leader, a unit is received and merged when the next name
    taken needs it; on another rank, `close` sends its tensors of every unit, in order."""

    def __init__(self, gather: ShardGather):
        self.g = gather
        self._units, self._unit, self._next = gather.units(), 0, 0
        self._ready: dict[str, torch.Tensor] = {}
        self._mine = gather.local() if gather.data_rank == 0 else {}

    def specs(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, self.g.meta[name]) for name in self.g.names]

    def take(self, count: int) -> list[tuple[str, torch.Tensor]]:
        if not self.g.dp.is_leader:
            return []
        out = []
        for name in self.g.names[self._next : self._next + count]:
            while self._unit <= self.g.unit_of(name):
                self._receive_unit()
            out.append((name, self._ready.pop(name)))
        self._next += len(out)
        return out

    def _receive_unit(self) -> None:
        stage, keep, to_hf = self._units[self._unit]
        self._unit += 1
        shards = []
        for rank_in_tp in range(self.g.tp):
            source = self.g.source[(stage, rank_in_tp)]
            if source == dist.get_rank():
                shards.append({k: v for k, v in self._mine.items() if keep(k)})
                continue
            shapes, part = self.g.shapes(stage, rank_in_tp), {}
            for name in sorted(k for k in shapes if keep(k)):
                part[name] = torch.empty(shapes[name].shape, dtype=shapes[name].dtype)
                dist.recv(part[name], src=source)
            shards.append(part)
        self._ready.update(to_hf(shards))

    def close(self) -> None:
        if self.g.dp.is_leader:
            self.take(len(self.g.names) - self._next)
            self._ready.clear()
            return
        for stage, keep, _ in self._units:
            if self.g.data_rank == 0 and stage == self.g.position[0]:
                for name in sorted(k for k in self._mine if keep(k)):
                    dist.send(self._mine[name].contiguous(), dst=0)
