"""DeepSpeed pipeline-engine checkpoints (what deepspeed.PipelineEngine.save_checkpoint writes,
and so every Megatron-DeepSpeed run), read here; nothing is ever written into them.

    <dir>/latest                                      the tag of the newest save (checkpoint/
                                                      files.py: deepspeed_tag)
    <dir>/global_step100/layer_XX[-model_TT]-model_states.pt
                                                      PipelineModule layer XX's state_dict (of
                                                      tensor rank TT); tied layers that use a
                                                      forward_fn are not saved
    <dir>/global_step100/mp_rank_MM_model_states.pt   the engine's state of model rank MM (a
                                                      stage and tensor rank): global_steps,
                                                      lr_scheduler, ZeRO-0's optimizer, ZeRO's
                                                      param_shapes, and the client state
    <dir>/global_step100/[bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt
                                                      ZeRO-1/2: data-parallel rank D's partition
                                                      of the flat fp32 groups and their Adam state

    files.py        the layout of a tag directory, reading its files safely, what the files say
                    of the run (client state, layout, precision)
    zero.py         the optimizer state per parameter name: ZeRO-0's torch state (names by module
                    order and param groups) and ZeRO-1/2's flat partitions (param_shapes)
    megatron_ds.py  Megatron-DeepSpeed's GPTModelPipe -> this project's model, for --load (names
                    through checkpoint/megatron/mapping.py)
    inspect.py      m2bw-inspect's report of a DeepSpeed checkpoint

Owns: reading DeepSpeed's pipeline checkpoint files (the drop-in's engine.load_checkpoint reads
real DeepSpeed's through files.py and zero.py; --load through megatron_ds.py).
Must not import: planner, deepspeed, testing, pretrain, generate.
"""
