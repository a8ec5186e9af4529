"""DeepSpeed's checkpoint layout for the pipeline engine (save, load, re-shard):

    <dir>/latest                                       the tag (written last)
    <dir>/<tag>/layer_{idx:02d}-model_states.pt        one layer's weights (fp32), any layout
    <dir>/<tag>/mp_rank_{stage:02d}_model_states.pt    a stage's engine state (both 2BW versions,
                                                       optimizer, scaler, steps) + client_state
    <dir>/<tag>/*.pt.sha256                            each file's checksum (checkpoint/files.py)
    <dir>/.tmp-<tag>/                                  a save in progress

Per-layer files make weights loadable under a different stage count; the optimizer state and the
2BW previous version are then re-sharded by parameter name from all stage files.

A save has the guarantees of the native layouts: every file is written atomically with its
checksum (write_with_checksum) into `.tmp-<tag>`; once every rank's files are durable (agreed
over the grid), rank 0 renames the directory to `<tag>` and only then rewrites `latest`
atomically. A failed save is one CheckpointError on every rank and leaves `latest` and the tag
it names as they were; a killed one leaves only `.tmp-<tag>` (removed by the next save).
Re-saving the tag `latest` names swaps the directories with two renames on rank 0 (a crash
between them leaves the old tag under a `.tmp-` name and `latest` naming no directory).
A load verifies each file against its checksum when the tag has checksums (tags written by
DeepSpeed itself, restored as DeepSpeed does by from_deepspeed.py, or by earlier versions have
none); a damaged or missing file is one CheckpointError naming it, raised on every rank.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
from operator import attrgetter

import torch

from megatron_2bw.checkpoint.files import (TMP_PREFIX, CheckpointError, agree,
                                           read_checkpoint_file, remove_temporary_files,
                                           write_checkpoint_file, write_error, write_with_checksum)
from megatron_2bw.config.input_files import read_text
from megatron_2bw.deepspeed.from_deepspeed import (load_deepspeed_state, read_foreign,
                                                  returned_client_state)
from megatron_2bw.fs import fsync_directory, unique_temp, writable_problem
from megatron_2bw.optim.distributed import full_state

LATEST = "latest"

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
        grid = self._engine.grid
        final = os.path.join(save_dir, tag)
        staging = os.path.join(save_dir, TMP_PREFIX + tag.replace(os.sep, "_"))
        problem = agree(_start_save(save_dir, staging) if self.global_rank == 0 else None, grid)
        if problem is None:  # every rank writes its files, then agrees they are durable
            engine_state = self._unsharded_state()
            if self.grid.get_data_parallel_rank() == 0:
                problem = self._write_stage(staging, client_state, engine_state)
            problem = agree(problem, grid)
        if problem is None:  # rank 0 renames the tag into place, then moves `latest`
            if self.global_rank == 0:
                problem = _publish(save_dir, staging, final, tag, save_latest)
            problem = agree(problem, grid)
        if problem:
            if self.global_rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            grid.comm.barrier()  # every rank returns once the temporary is gone
            raise CheckpointError(f"{problem}; {_kept(save_dir)}")
        return True

    def _unsharded_state(self) -> dict:
        """The engine state, its optimizer state whole on data-parallel rank 0 (collective under
        ZeRO-1 / the distributed optimizer: every replica's shard is gathered, so the checkpoint
        is the one an unsharded run writes and loads under any layout)."""
        state = self._engine.state_dict()
        if not self._engine.weights.sharded:
            return state
        shards = self._engine.grid.comm.gather_objects((self.stage_id, state["optimizer"]))
        if self.grid.get_data_parallel_rank() == 0:
            state["optimizer"] = full_state([o for stage, o in shards if stage == self.stage_id])
        return state

    def _write_stage(self, staging: str, client_state: dict, engine_state: dict) -> str | None:
        """This stage's layer files and state file into `staging`; the problem, if any."""
        try:
            for idx, sd in self._layer_state_dicts().items():
                write_with_checksum(os.path.join(staging, self.module.ckpt_layer_name(idx)),
                                    lambda f, sd=sd: torch.save(sd, f))
            w = self._engine.weights
            state = {"module": None, "buffer_names": [], "optimizer": None,
                     "lr_scheduler": {"last_batch_iteration": self.global_steps - 1},
                     "global_steps": self.global_steps, "global_samples": self.global_samples,
                     "skipped_steps": self.skipped_steps, "dp_world_size": self.dp_world_size,
                     "mp_world_size": self.mp_world_size, "ds_config": self._config,
                     "ds_version": "megatron_2bw",
                     "megatron_2bw": {"engine": engine_state,
                                      "shapes": [tuple(s) for s in w.shapes],
                                      "parts": list(self.module.parts),
                                      "num_stages": self.num_stages, "stage": self.stage_id}}
            state.update(client_state)
            write_with_checksum(self._state_file(staging), lambda f: torch.save(state, f))
        except CheckpointError as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - reported to every rank, not raised on one
            first = str(e).splitlines()[0] if str(e) else ""
            return f"writing a checkpoint into {staging} failed: {type(e).__name__}: {first}"
        return None

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False, custom_load_fn=None):
        """Collective. Returns (path of this stage's state file, client_state), or (None, None)
        when there is no checkpoint. Weights come from the per-layer files (any stage count);
        the engine state loads directly when the layout matches, else it is re-sharded by name.
        A damaged or missing file is one CheckpointError, the same on every rank."""
        if tag is None:
            latest = os.path.join(load_dir, LATEST)
            if not os.path.isfile(latest):
                if self.global_rank == 0:
                    print(f"warning: no 'latest' file in {load_dir}: no checkpoint loaded",
                          flush=True)
                return None, None
            tag = read_text(latest, "it names the checkpoint tag to load (save_checkpoint "
                            "writes it): fix it or pass tag=", CheckpointError).strip()
        path = os.path.join(load_dir, str(tag))
        problem, read = None, None
        try:
            read = self._read_checkpoint(path, load_module_strict, load_optimizer_states,
                                         load_module_only, load_lr_scheduler_states)
        except CheckpointError as e:
            problem = str(e)
        except Exception as e:  # noqa: BLE001 - a file that unpickles into the wrong shape
            first = str(e).splitlines()[0] if str(e) else ""
            problem = f"cannot load checkpoint {path}: {type(e).__name__}: {first}"
        problem = agree(problem, self._engine.grid)
        if problem:
            raise CheckpointError(problem)
        state, buffers, meta, client = read
        eng, w = self._engine, self._engine.weights
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
        return self._state_file(path), client

    def _read_checkpoint(self, path, strict, load_optimizer, module_only, load_lr=True):
        """(engine state, buffers, the contents of this stage's state file, client_state) of the
        tag `path` (no collective); a tag DeepSpeed wrote: from_deepspeed.py."""
        if not os.path.isdir(path):
            raise CheckpointError(f"checkpoint directory {path} does not exist: check the tag "
                                  "or the 'latest' file next to it")
        verify = bool(glob.glob(os.path.join(path, "*.sha256")))  # written with checksums

        def read(file: str) -> dict:  # DeepSpeed's own files hold its classes: the allow-list
            return read_checkpoint_file(file, weights_only=False) if verify else \
                read_foreign(file)

        eng, w = self._engine, self._engine.weights
        state = eng.state_dict()
        names = list(state["names"])
        index = {n: i for i, n in enumerate(names)}
        newest = state["newest"].clone()
        buffers = self._load_layer_files(path, newest, index, w.offsets, strict, read)
        state["newest"] = newest
        state_file = self._state_file(path)
        meta = read(state_file) if os.path.isfile(state_file) or \
            os.path.isfile(state_file + ".sha256") else {}
        ours = meta.get("megatron_2bw")
        client = {k: v for k, v in meta.items() if k not in STATE_KEYS}
        if ours is None:  # written by DeepSpeed itself
            zero = self.zero_optimization_stage() > 0
            client = returned_client_state(meta, load_optimizer, load_lr, module_only, zero)
            if module_only:
                state.pop("previous", None)
            else:
                state = load_deepspeed_state(path, self, state, meta, load_optimizer, load_lr)
        elif module_only:
            state.pop("previous", None)
            client = {}
        elif ours["engine"]["names"] == names and \
                [tuple(s) for s in ours["shapes"]] == [tuple(s) for s in w.shapes]:
            loaded = ours["engine"]
            if not load_optimizer:
                loaded = {**loaded, "optimizer": state["optimizer"]}
            state = loaded
        else:
            state = self._reshard(path, state, names, load_optimizer, read)
        return state, buffers, meta, client

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

    def _load_layer_files(self, path, newest, index, offsets, strict, read) -> dict[int, dict]:
        """Copy every local layer's saved weights into `newest` (fp32 flat); returns buffers.
        `read(file)` loads a file of the tag (checksum verified when it has them)."""
        eng = self._engine
        buffers = {}
        for idx in range(self.module._local_start, self.module._local_stop):
            layer = eng.module.layers[str(idx)].layer
            if layer is None or not layer.state_dict():
                continue
            file = self._layer_file(path, idx)
            if file is None:
                raise CheckpointError(f"checkpoint {path} has no file for layer {idx} "
                                      f"({self.module.layer_type_name(idx)}; expected "
                                      f"{self.module.ckpt_layer_name(idx)}): the save did not "
                                      "finish or the model differs; load another tag")
            sd = read(file)
            expected = layer.state_dict()
            if strict and set(sd) != set(expected):
                diff = sorted(set(sd) ^ set(expected))
                raise CheckpointError(f"layer {idx} in {file}: state dict keys differ "
                                      f"({diff[:3]}): the model differs from the saved one; "
                                      "pass load_module_strict=False to load what matches")
            param_names = {n for n, _ in layer.named_parameters()}
            for k, v in sd.items():
                name = f"layers.{idx}.layer.{k}"
                if k in param_names:
                    if name in index:
                        i = index[name]
                        shape = eng.weights.shapes[i]
                        if tuple(v.shape) != tuple(shape):
                            raise CheckpointError(
                                f"layer {idx} {k} in {file}: the checkpoint's shape "
                                f"{tuple(v.shape)} != the model's {tuple(shape)}: build the "
                                "model that saved it")
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

    def _reshard(self, path: str, state: dict, names: list[str], load_optimizer: bool,
                 read) -> dict:
        """Engine state for this stage's layout from all stage files of another layout."""
        sources = []  # (name -> (file state, offset, numel))
        for file in sorted(glob.glob(os.path.join(path, "mp_rank_*_model_states.pt"))):
            meta = read(file)
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
            raise CheckpointError(f"no megatron_2bw stage state in {path} (no "
                                  "mp_rank_*_model_states.pt of ours): load it with "
                                  "load_module_only=True, or load the tag that saved it")

        def locate(name):
            for alias in self._aliases(name):
                for es, table, total in sources:
                    if alias in table:
                        return es, table[alias], total
            raise CheckpointError(f"parameter {name} is in no stage file of {path}: the model "
                                  "differs from the saved one; load with load_module_only=True")

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


# -- save steps on rank 0 (each returns the problem, or None) --------------------------------------
def _start_save(save_dir: str, staging: str) -> str | None:
    """An empty `staging` directory, after removing what killed saves left in `save_dir`."""
    why = writable_problem(save_dir)
    if why:
        return f"cannot save a checkpoint into {save_dir}: it {why}: point save_dir elsewhere"
    try:
        remove_temporary_files(save_dir)
        os.makedirs(staging)
    except OSError as e:
        return write_error(staging, e, 0)
    return None


def _publish(save_dir: str, staging: str, final: str, tag: str, save_latest: bool) -> str | None:
    """Rename the complete `staging` to `final` (swapping out an older save of the same tag),
    then point `latest` at it."""
    old = None
    try:
        fsync_directory(staging)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        if os.path.lexists(final):
            old = str(unique_temp(final))
            os.rename(final, old)
        try:
            os.rename(staging, final)
        except OSError:
            if old is not None:
                os.rename(old, final)
            raise
        fsync_directory(os.path.dirname(final))
    except OSError as e:
        return write_error(final, e, 0)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if save_latest:
        try:
            write_checkpoint_file(os.path.join(save_dir, LATEST), lambda f: f.write(tag.encode()))
        except CheckpointError as e:
            return str(e)
    return None


def _kept(save_dir: str) -> str:
    latest = os.path.join(save_dir, LATEST)
    if not os.path.isfile(latest):
        return f"{save_dir} holds no 'latest' checkpoint"
    with open(latest) as f:
        return f"'latest' in {save_dir} still names {f.read().strip()!r}, which is intact"
