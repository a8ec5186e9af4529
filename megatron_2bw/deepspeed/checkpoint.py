"""DeepSpeed's checkpoint layout for the pipeline engine (save, load, re-shard):

    <dir>/latest                                       the tag
    <dir>/<tag>/layer_{idx:02d}-model_states.pt        one layer's weights (fp32), any layout
    <dir>/<tag>/mp_rank_{stage:02d}_model_states.pt    a stage's engine state (both 2BW versions,
                                                       optimizer, scaler, steps) + client_state

Per-layer files make weights loadable under a different stage count; the optimizer state and the
2BW previous version are then re-sharded by parameter name from all stage files.
"""
from __future__ import annotations

import glob
import os
import re
from operator import attrgetter

import torch

STATE_KEYS = ("module", "buffer_names", "optimizer", "lr_scheduler", "global_steps",
              "global_samples", "skipped_steps", "dp_world_size", "mp_world_size", "ds_config",
              "ds_version", "megatron_2bw")


class CheckpointMixin:
    """save_checkpoint / load_checkpoint of DeepSpeedPipelineEngine (which provides _engine,
    module, grid, stage_id, global_rank, global_steps and the other attributes used here)."""

    def _state_file(self, path: str, stage: int | None = None) -> str:
        return os.path.join(path, f"mp_rank_{self.stage_id if stage is None else stage:02d}"
                                  "_model_states.pt")

    def _layer_state_dicts(self) -> dict[int, dict]:
        """Newest weights of every local layer that has any state, in fp32, by layer index."""
        eng = self._engine
        newest = eng.module
        fp32 = eng.fp32_state()
        by_id = {id(p): fp32[name] for name, p in newest.named_parameters()}
        out = {}
        for idx in range(self.module._local_start, self.module._local_stop):
            layer = newest.layers[str(idx)].layer
            if layer is None:
                continue
            sd = layer.state_dict(keep_vars=True)
            out[idx] = {k: (by_id[id(v)] if id(v) in by_id else v).detach().clone()
                        if torch.is_tensor(v) else v for k, v in sd.items()}
        return out

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,
                        exclude_frozen_parameters=False):
        """Collective. Writes DeepSpeed's layout (see the module docstring); returns True."""
        if not save_dir:
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
        reserved = set(client_state) & set(STATE_KEYS)
        if reserved:
            raise KeyError(f"client_state uses reserved checkpoint key {sorted(reserved)[0]!r}")
        tag = str(tag if tag is not None else f"global_step{self.global_steps}")
        path = os.path.join(save_dir, tag)
        if self.global_rank == 0:
            os.makedirs(path, exist_ok=True)
        self._engine.grid.comm.barrier()
        if self.grid.get_data_parallel_rank() == 0:
            for idx, sd in self._layer_state_dicts().items():
                torch.save(sd, os.path.join(path, self.module.ckpt_layer_name(idx)))
            w = self._engine.weights
            state = {"module": None, "buffer_names": [], "optimizer": None,
                     "lr_scheduler": {"last_batch_iteration": self.global_steps - 1},
                     "global_steps": self.global_steps, "global_samples": self.global_samples,
                     "skipped_steps": self.skipped_steps, "dp_world_size": self.dp_world_size,
                     "mp_world_size": self.mp_world_size, "ds_config": self._config,
                     "ds_version": "megatron_2bw",
                     "megatron_2bw": {"engine": self._engine.state_dict(),
                                      "shapes": [tuple(s) for s in w.shapes],
                                      "parts": list(self.module.parts),
                                      "num_stages": self.num_stages, "stage": self.stage_id}}
            state.update(client_state)
            torch.save(state, self._state_file(path))
        self._engine.grid.comm.barrier()
        if save_latest and self.global_rank == 0:
            with open(os.path.join(save_dir, "latest"), "w") as f:
                f.write(tag)
        self._engine.grid.comm.barrier()
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False, custom_load_fn=None):
        """Collective. Returns (path of this stage's state file, client_state), or (None, None)
        when there is no checkpoint. Weights come from the per-layer files (any stage count);
        the engine state loads directly when the layout matches, else it is re-sharded by name."""
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if not os.path.isfile(latest):
                if self.global_rank == 0:
                    print(f"warning: no 'latest' file in {load_dir}: no checkpoint loaded",
                          flush=True)
                return None, None
            with open(latest) as f:
                tag = f.read().strip()
        path = os.path.join(load_dir, str(tag))
        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint directory {path} does not exist")
        eng, w = self._engine, self._engine.weights
        state = eng.state_dict()
        names = list(state["names"])
        index = {n: i for i, n in enumerate(names)}
        offsets = w.offsets
        newest = state["newest"].clone()
        buffers = self._load_layer_files(path, newest, index, offsets, load_module_strict)
        state["newest"] = newest
        state_file = self._state_file(path)
        meta = torch.load(state_file, map_location="cpu", weights_only=False) \
            if os.path.isfile(state_file) else {}
        ours = meta.get("megatron_2bw")
        client = {k: v for k, v in meta.items() if k not in STATE_KEYS}
        if load_module_only:
            state.pop("previous", None)
            client = {}
        elif ours is None:  # weights only (e.g. a checkpoint written by DeepSpeed itself)
            state.pop("previous", None)
            state["iteration"] = int(meta.get("global_steps", state["iteration"]))
        elif ours["engine"]["names"] == names and \
                [tuple(s) for s in ours["shapes"]] == [tuple(s) for s in w.shapes]:
            loaded = ours["engine"]
            if not load_optimizer_states:
                loaded = {**loaded, "optimizer": state["optimizer"]}
            state = loaded
        else:
            state = self._reshard(path, state, names, load_optimizer_states)
        device = w.slots[0].device
        state = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in state.items()}
        eng.load_state_dict(state)
        for replica in w.modules:
            for idx, bufs in buffers.items():
                layer = replica.layers[str(idx)].layer
                for name, value in bufs.items():
                    attrgetter(name)(layer).copy_(value)
        if not load_module_only:
            self.global_samples = int(meta.get("global_samples",
                                               self.global_steps * self.train_batch_size()))
        self._engine.grid.comm.barrier()
        return state_file, client

    def _layer_file(self, path: str, idx: int) -> str | None:
        keys = [idx]
        entry = self.module._entries.get(idx)
        if entry and entry[0] == "tied":  # DeepSpeed skips tied layers that use forward_fn
            keys += [j for j in self.module._tie_layers[entry[1]] if j != idx]
        for j in keys:
            exact = os.path.join(path, self.module.ckpt_layer_name(j))
            if os.path.isfile(exact):
                return exact
            found = sorted(glob.glob(os.path.join(path, f"layer_{j:02d}-*model_states.pt")))
            if found:
                return found[0]
        return None

    def _load_layer_files(self, path, newest, index, offsets, strict) -> dict[int, dict]:
        """Copy every local layer's saved weights into `newest` (fp32 flat); returns buffers."""
        eng = self._engine
        buffers = {}
        for idx in range(self.module._local_start, self.module._local_stop):
            layer = eng.module.layers[str(idx)].layer
            if layer is None or not layer.state_dict():
                continue
            file = self._layer_file(path, idx)
            if file is None:
                raise FileNotFoundError(f"checkpoint {path} has no file for layer {idx} "
                                        f"({self.module.layer_type_name(idx)})")
            sd = torch.load(file, map_location="cpu", weights_only=False)
            expected = layer.state_dict()
            if strict and set(sd) != set(expected):
                diff = sorted(set(sd) ^ set(expected))
                raise RuntimeError(f"layer {idx} in {file}: state dict keys differ ({diff[:3]})")
            param_names = {n for n, _ in layer.named_parameters()}
            for k, v in sd.items():
                name = f"layers.{idx}.layer.{k}"
                if k in param_names:
                    if name in index:
                        i = index[name]
                        shape = eng.weights.shapes[i]
                        if tuple(v.shape) != tuple(shape):
                            raise RuntimeError(f"layer {idx} {k}: the checkpoint's shape "
                                               f"{tuple(v.shape)} != the model's {tuple(shape)}")
                        newest[offsets[i]:offsets[i] + shape.numel()] = v.reshape(-1).to(newest)
                elif torch.is_tensor(v) and k in expected:
                    buffers.setdefault(idx, {})[k] = v
        return buffers

    def _aliases(self, name: str) -> list[str]:
        """The same tied parameter under the other layer indices of its key."""
        m = re.match(r"layers\.(\d+)\.(.*)", name)
        out = [name]
        if m:
            idx, rest = int(m.group(1)), m.group(2)
            spec = self.module._layer_specs[idx]
            key = getattr(spec, "key", None)
            if key is not None:
                out += [f"layers.{j}.{rest}" for j in self.module._tie_layers.get(key, [])
                        if j != idx]
        return out

    def _reshard(self, path: str, state: dict, names: list[str], load_optimizer: bool) -> dict:
        """Engine state for this stage's layout from all stage files of another layout."""
        sources = []  # (name -> (file state, offset, numel))
        for file in sorted(glob.glob(os.path.join(path, "mp_rank_*_model_states.pt"))):
            meta = torch.load(file, map_location="cpu", weights_only=False)
            ours = meta.get("megatron_2bw")
            if ours is None:
                continue
            es, off, table = ours["engine"], 0, {}
            for n, s in zip(es["names"], ours["shapes"]):
                numel = torch.Size(s).numel()
                table[n] = (off, numel)
                off += numel
            sources.append((es, table, off))
        if not sources:
            raise FileNotFoundError(f"no megatron_2bw stage state in {path}")

        def locate(name):
            for alias in self._aliases(name):
                for es, table, total in sources:
                    if alias in table:
                        return es, table[alias], total
            raise KeyError(f"parameter {name} is in no stage file of {path}")

        def assemble(get_flat, like):
            out = like.clone()
            pos = 0
            for n in names:
                es, (off, numel), total = locate(n)
                out[pos:pos + numel] = get_flat(es, total)[off:off + numel]
                pos += numel
            return out

        first = sources[0][0]
        new = dict(state)
        new["iteration"], new["skipped"] = first["iteration"], first["skipped"]
        new["scaler"] = first["scaler"]
        if "previous" in state:
            new["previous"] = assemble(lambda es, t: es.get("previous", es["newest"]),
                                       state["previous"])
        if load_optimizer:
            opt = dict(state["optimizer"])
            for k, v in opt.items():
                if torch.is_tensor(v) and v.dim() == 1 and v.numel() == state["newest"].numel():
                    opt[k] = assemble(lambda es, t, k=k: es["optimizer"][k], v)
                elif not torch.is_tensor(v):
                    opt[k] = first["optimizer"].get(k, v)
            new["optimizer"] = opt
        return new
