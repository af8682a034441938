"""Every class of bad input a user can give the command lines, with several examples each: exit code
2, exactly one line on stderr, `raytrain: error: ...` naming the key (or file, or flag), no
traceback, nothing written. Each example runs as `--dry-run` and as a real run; a real run must
refuse before `ray.init` (no Ray is started in this file). Calls `main(argv)` in-process (no Ray
involved, so no subprocess is needed); `test_a_real_run_is_refused_by_the_process` proves the same
at the process level.

The battery the issue was tested with lives outside the repo and will be run again with other
cases of the same classes: the rows here are examples of each class, not the cases themselves."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from raytrain.main import main as train_main
from raytrain.tools.export import main as export_main
from raytrain.tools.plan import main as plan_main
from raytrain.tools.preflight import main as preflight_main

Z3 = '"zero_optimization": {"stage": 3'

# class -> [(argv (FILES is replaced by the fixture directory), what the error line must name)]
CLASSES: dict[str, list[tuple[list[str], str]]] = {
    "config file": [
        (["--config", "FILES/adir"], "config file FILES/adir is a directory"),
        (["--config", "FILES/missing.yaml"], "config file FILES/missing.yaml does not exist"),
        (["--config", "FILES/latin1.yaml"], "config file FILES/latin1.yaml is not UTF-8 text (byte 0xe9 at line 2)"),
        (["--config", "/proc/self/mem"], "config file /proc/self/mem cannot be read"),
        (["--config", "FILES/broken.yaml"], "config file FILES/broken.yaml is not valid YAML"),
        (["--config", "FILES/list.yaml"], "config file FILES/list.yaml must be a mapping of sections"),
        (["--config", "FILES/rayup.yaml"], "config file FILES/rayup.yaml is a Ray cluster file (for ray up), not a run "
                                           "config: pass a run config such as configs/llama-1b-1gpu.yaml"),
    ],
    "YAML duplicate keys": [
        (["--config", "FILES/twice.yaml"], "FILES/twice.yaml line 4: key training is given twice (first at line 1)"),
        (["--config", "FILES/twice_nested.yaml"], "line 3: key training.max_steps is given twice"),
        (['deepspeed={"train_batch_size": 8, "train_batch_size": 16}'], "override deepspeed line 1: key train_batch_size"),
        (["deepspeed=FILES/twice.json"], "deepspeed: FILES/twice.json has the key 'zero_optimization' twice"),
    ],
    "overrides": [
        (["training.max_steps"], "override 'training.max_steps' is not KEY=VALUE"),
        (["training..max_steps=3"], "has an empty part between dots"),
        (["training.max_step=3"], "unknown key training.max_step; did you mean training.max_steps?"),
        (["trainin.max_steps=3"], "unknown key trainin; did you mean training?"),
        (["training.seq_len=64"], "unknown key training.seq_len; did you mean data.seq_len?"),
        (["training.max_steps.x=1"], "training.max_steps must be an integer >= 1, got dict {'x': 1}"),
        (["training.max_steps=5", "training.max_steps.x=1"], "override training.max_steps.x: training.max_steps is a "
                                                             "value, not a section"),
        (["training=5"], "training must be a mapping, got 5"),
        (["--config", "FILES/commented.yaml"], "training must be a mapping, got null: YAML reads a section with "
                                               "nothing under it (all commented out) as null; write training: {}"),
        (["deepspeed=no/such/ds.json"], "deepspeed: file no/such/ds.json does not exist (relative to the current "
                                        "directory "),
        (["training.max_steps=20", "training.max_steps=30"], "training.max_steps is given twice on the command line "
                                                             "(training.max_steps=20 and training.max_steps=30)"),
        (['training={"max_steps": 3}', "training.max_steps=5"], "training.max_steps is given twice"),
        (["--resume-from", "FILES/ck", "checkpoint.resume_from=FILES/ck"], "checkpoint.resume_from is given twice"),
        (["--config", "FILES/list.yaml", "--config", "FILES/twice.yaml"], "--config is given 2 times"),
        (["run.yaml"], "override 'run.yaml' is not KEY=VALUE: a run config file comes after --config: --config run.yaml"),
        # a '#' on the command line is part of the value (YAML would read " # five" as a comment)
        (["training.max_steps=5 # five"], "training.max_steps must be an integer >= 1, got str '5 # five'"),
    ],
    "empty paths and names": [
        (['data.path=""'], "data.path must be a string (not empty) or a list of strings (not empty) or null, got str ''"),
        (["data.path=[]"], "data.path must be a string (not empty)"),
        (['model.tokenizer=""'], "model.tokenizer must be a string (not empty) or null"),
        (['checkpoint.export_dir=""'], "checkpoint.export_dir must be a string (not empty) or null"),
        (['checkpoint.resume_from=""'], "checkpoint.resume_from must be a string (not empty) or null"),
        (["--resume-from", ""], "checkpoint.resume_from must be a string (not empty) or null"),
        (['tracking.mlflow_tracking_uri=""'], "tracking.mlflow_tracking_uri must be a string (not empty) or null"),
        (['data.eval_hf_split=""'], "data.eval_hf_split must be a string (not empty), got str ''"),
    ],
    "--resume-from is a path, taken as written": [
        (["--resume-from", "FILES/ck #2"], "checkpoint.resume_from=FILES/ck #2 is not a raytrain checkpoint"),
        (["--resume-from", "yes"], "/yes is not a raytrain checkpoint"),  # a directory named yes, not true
    ],
    "training values the DeepSpeed JSON would override or ignore": [
        (['deepspeed={"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, %s}}' % Z3, "training.learning_rate=3e-4"],
         "training.learning_rate=0.0003 contradicts deepspeed.optimizer.params.lr=0.0001"),
        (['deepspeed={"gradient_clipping": 1.0, %s}}' % Z3, "training.gradient_clipping=0.5"],
         "training.gradient_clipping=0.5 contradicts deepspeed.gradient_clipping=1.0"),
        (['deepspeed={"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, %s}}' % Z3, "training.weight_decay=0.01"],
         "training.weight_decay=0.01 would be ignored: deepspeed.optimizer (AdamW) has no params.weight_decay"),
        (['deepspeed={"bf16": {"enabled": true}, %s}}' % Z3, "training.precision=fp32"],
         "training.precision=fp32 contradicts deepspeed.bf16.enabled=true"),
        (['deepspeed={"fp16": {"enabled": true}, %s}}' % Z3, "training.precision=bf16", "scaling.use_gpu=true",
          "scaling.num_workers=2"],
         "training.precision=bf16 contradicts deepspeed.fp16.enabled=true"),
        (["training.precision=fp16"], "training.precision=fp16 needs GPUs, and this run is on CPU"),
    ],
    "run-config types and ranges": [
        (["training.warmup_steps=-1"], "training.warmup_steps must be an integer >= 0, got -1"),
        (["training.adam_betas=[0.9]"], "training.adam_betas must be a list of 2 numbers in [0, 1), got list [0.9]"),
        (["training.adam_betas=[0.9, 1.5]"], "training.adam_betas[1] must be a number in [0, 1), got 1.5"),
        (["checkpoint.max_failures=-1"], "checkpoint.max_failures must be an integer >= 0, got -1"),
        (["training.micro_batch_size_per_gpu=0"], "training.micro_batch_size_per_gpu must be an integer >= 1"),
        (["training.learning_rate=fast"], "training.learning_rate must be a number > 0, got str 'fast'"),
        (["training.max_steps=2.5"], "training.max_steps must be an integer >= 1, got 2.5"),
        (["training.precision=bf32"], "training.precision must be fp32, bf16 or fp16 or null, got str 'bf32'"),
        (["data.eval_fraction=1.0"], "data.eval_fraction must be a number in [0, 1), got 1.0"),
        (["data.format=xml"], "data.format must be auto, text, json, csv, parquet, hf or tokenized"),
        (["data.seq_len=0"], "data.seq_len must be an integer >= 1, got 0"),
        (["data.eval_fraction=0.1", "data.eval_path=x"], "data.eval_path and data.eval_fraction are both set"),
        (["tracking.tensorboard=2"], "tracking.tensorboard must be true or false, got 2"),
    ],
    "model": [
        (["model.attn_implementation=sdpa2"], "model.attn_implementation='sdpa2' is not an attention implementation "
                                              "transformers knows: did you mean sdpa?"),
        (["model.config.hiden_size=64"], "model.config.hiden_size: LlamaConfig has no such field; "
                                         "did you mean model.config.hidden_size?"),
        (['model.config.hidden_size="64"'], "model.config.hidden_size='64': the model's config refuses it"),
        (["model.config.num_attention_heads=3"], "model.config.num_attention_heads=3: the model's config refuses it"),
        (["model.name_or_path=FILES/adir"], "model.name_or_path='FILES/adir': cannot load its config"),
        # a raytrain checkpoint or run holds DeepSpeed shards, no config.json: the fix is the export or --resume-from
        (["model.name_or_path=FILES/arun/checkpoint_step_00000004", "model.pretrained=true"],
         "model.name_or_path=FILES/arun/checkpoint_step_00000004 is a raytrain checkpoint, not a Hugging Face model "
         "directory: export it (python -m raytrain.tools.export FILES/arun/checkpoint_step_00000004 OUT_DIR) and set "
         "model.name_or_path=OUT_DIR model.pretrained=true to train from its weights, or pass --resume-from "
         "FILES/arun/checkpoint_step_00000004 to continue its training"),
        (["model.name_or_path=FILES/arun"], "model.name_or_path=FILES/arun is a raytrain run's directory (its latest "
                                            "checkpoint is checkpoint_step_00000004), not a Hugging Face model "
                                            "directory: export it (python -m raytrain.tools.export "
                                            "FILES/arun/checkpoint_step_00000004 OUT_DIR)"),
        (["model.liger_kernel=fast"], "model.liger_kernel must be none, loss or all"),
        (["data.seq_len=4096"], "data.seq_len=4096 exceeds the model's max_position_embeddings=1024"),
        # each passed the driver and failed every worker (or was ignored: dtype)
        (["model.attn_implementation=flash_attention_2"], "model.attn_implementation=flash_attention_2 runs on GPUs "
                                                          "only, and this run's workers have none"),
        (["model.config.hidden_act=gelu_fast2"], "model.config.hidden_act='gelu_fast2' is not an activation "
                                                 "transformers knows: did you mean gelu_fast?"),
        (["model.config.pad_token_id=400"], "model.config.pad_token_id=400 is outside the model's vocabulary "
                                            "(vocab_size=320)"),
        (['model.config.rope_scaling={"rope_type": "linear"}'], "model.config.rope_scaling={'rope_type': 'linear'}: the "
                                                                "model's config refuses it (Missing required keys"),
        (["model.config.intermediate_size=-3"], "model.config.intermediate_size=-3: the model cannot be built with it"),
        (["model.config.dtype=bfloat16"], "model.config.dtype='bfloat16' does not set the training precision, which "
                                          "the DeepSpeed config holds: remove it and set training.precision=bf16"),
    ],
    "DeepSpeed JSON": [
        (['deepspeed={"bf16": true}'], "deepspeed.bf16 must be a mapping"),
        (['deepspeed={%s, "offload_optimizer": "cpu"}}' % Z3],
         "deepspeed.zero_optimization.offload_optimizer must be a mapping"),
        (['deepspeed={%s, "zero_hpz_partition_size": "2"}}' % Z3],
         'deepspeed.zero_optimization.zero_hpz_partition_size is the string "2", but DeepSpeed reads a number'),
        (['deepspeed={"steps_per_prnt": 10, %s}}' % Z3], "deepspeed.steps_per_prnt is not a key DeepSpeed reads"),
        (["deepspeed.zero_optimisation.stage=2"], "deepspeed.zero_optimisation is not a key DeepSpeed reads (it would be "
                                                  "ignored); did you mean deepspeed.zero_optimization?"),
        (["deepspeed.zero_optimization.overlap_com=true"], "did you mean deepspeed.zero_optimization.overlap_comm?"),
        (["deepspeed.zero_optimization.offload_param.device=gpu"],
         "deepspeed.zero_optimization.offload_param.device must be 'none', 'cpu' or 'nvme'"),
        (["deepspeed.zero_optimization.reduce_bucket_size=-1"],
         "deepspeed.zero_optimization.reduce_bucket_size must be greater than 0"),
        # DeepSpeed's old offload spelling: raytrain would plan and build its optimizer without the offload
        (['deepspeed={%s, "cpu_offload": true}}' % Z3], "deepspeed.zero_optimization.cpu_offload is DeepSpeed's old "
                                                        "spelling, which raytrain does not read"),
        (['deepspeed={"steps_per_print": 0, %s}}' % Z3], "deepspeed.steps_per_print=0 must be a positive integer"),
        (['deepspeed={%s, "zero_quantized_gradients": true}}' % Z3],
         "deepspeed.zero_optimization.zero_quantized_gradients=true needs GPUs"),
        (['deepspeed={%s, "prefetch_bucket_size": 1000, "stage3_prefetch_bucket_size": 1000}}' % Z3],
         "deepspeed.zero_optimization.stage3_prefetch_bucket_size=1000 and deepspeed.zero_optimization.prefetch_bucket_"
         "size=1000 are one setting under two names"),
        (["training.micro_batch_size_per_gpu=1000000000000"], "deepspeed.train_micro_batch_size_per_gpu=1000000000000 x "
                                                              "data.seq_len=128"),
        (['deepspeed={"train_micro_batch_size_per_gpu": 1000000000000, %s}}' % Z3],
         "deepspeed.train_micro_batch_size_per_gpu=1000000000000 x data.seq_len=128"),
        (['deepspeed={"activation_checkpointing": {"partition_activations": "false"}, %s}}' % Z3],
         'deepspeed.activation_checkpointing.partition_activations is the string "false"'),
        (['deepspeed={"optimizer": {"type": "AdamW", "params": {"betaz": [0.9, 0.9]}}, %s}}' % Z3],
         "deepspeed.optimizer.params.betaz is not a parameter of AdamW"),
        # optimizer and scheduler params reach their constructors as written, in the workers
        (['deepspeed={"optimizer": {"type": "AdamW", "params": {"lr": "3e-4", "torch_adam": true}}, %s}}' % Z3],
         'deepspeed.optimizer.params.lr is the string "3e-4", but DeepSpeed reads a number there: write 3e-4 '
         'without quotes'),
        (['deepspeed={"optimizer": {"type": "AdamW", "params": {"betas": ["0.9", 0.95]}}, %s}}' % Z3],
         'deepspeed.optimizer.params.betas[0] is the string "0.9"'),
        (['deepspeed={"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "100"}}, %s}}' % Z3],
         'deepspeed.scheduler.params.warmup_num_steps is the string "100"'),
        (['deepspeed={"optimizer": {"type": "AdamW", "params": {"lr": -1e-4}}, %s}}' % Z3],
         "deepspeed.optimizer.params.lr=-0.0001 is negative: write a value >= 0"),
        (['deepspeed={"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.5]}}, %s}}' % Z3],
         "deepspeed.optimizer.params.betas[1]=1.5 is outside [0, 1)"),
        (['deepspeed={"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -5}}, %s}}' % Z3],
         "deepspeed.scheduler.params.warmup_num_steps=-5 is negative"),
        # torch's schedulers are built on DeepSpeed's optimizer wrapper, which they refuse (in every worker)
        (['deepspeed={"scheduler": {"type": "StepLR", "params": {"step_size": 10}}, %s}}' % Z3],
         "deepspeed.scheduler.type='StepLR' is torch's, which DeepSpeed builds on its own optimizer wrapper under "
         "ZeRO stage 3"),
        (['deepspeed={"gradient_clipping": -1.0, %s}}' % Z3],
         "deepspeed.gradient_clipping=-1.0 is negative, which DeepSpeed reads as no clipping"),
        (['deepspeed={"optimizer": {"type": "Lion", "params": {"lr": 1e-4, "weight_decai": 0.01}}, %s}}' % Z3],
         "deepspeed.optimizer.params.weight_decai is not a parameter of Lion, which DeepSpeed builds as FusedLion "
         "here (its constructor would refuse it in the workers); did you mean deepspeed.optimizer.params.weight_decay?"),
        (['deepspeed={"optimizer": {"type": "Adagrad", "params": {"lr": 1e-2, "epz": 1e-8}}, %s}}' % Z3],
         "deepspeed.optimizer.params.epz is not a parameter of Adagrad"),
        (["deepspeed.zero_optimization.stage=true"], "deepspeed.zero_optimization.stage is true, but it is a stage number"),
        (["deepspeed.zero_optimization.stage=5"], "deepspeed.zero_optimization.stage must be 0, 1, 2 or 3 (DeepSpeed's "
                                                  "rule), got int 5"),
        (['deepspeed={"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 1000, '
          '"warmup_num_steps": 10}}, %s}}' % Z3, "training.max_steps=100"],
         "training.max_steps=100 contradicts deepspeed.scheduler.params.total_num_steps=1000"),
        (['deepspeed={"train_batch_size": 512, "gradient_accumulation_steps": 4, %s}}' % Z3,
          "training.micro_batch_size_per_gpu=4"],
         "deepspeed.train_batch_size=512 != training.micro_batch_size_per_gpu=4 x "
         "deepspeed.gradient_accumulation_steps=4 x world size 2 = 32"),
        (["deepspeed=FILES/missing.json"], "deepspeed: file FILES/missing.json does not exist"),
        (["deepspeed=FILES/broken.json"], "deepspeed: FILES/broken.json is not valid JSON"),
        (["deepspeed=FILES/adir"], "deepspeed: file FILES/adir is a directory"),
        (["deepspeed=FILES/list.json"], "deepspeed: FILES/list.json must hold a JSON object"),
        (["deepspeed=5"], "deepspeed must be a mapping or a string (not empty), got 5"),
        (['deepspeed={"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, %s}}' % Z3],
         "deepspeed.optimizer.type='SGD' is not an optimizer ZeRO (stage 3) supports"),
        (['deepspeed={"optimizer": {"type": "AdamW", "params": {"fused": false}}, %s}}' % Z3],
         "deepspeed.optimizer.params.fused is not a parameter of AdamW"),
        (['deepspeed={"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}, %s}}' % Z3],
         "deepspeed.optimizer.params.max_grad_norm is not an optimizer parameter: clip with deepspeed.gradient_clipping"),
        (['deepspeed={"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}}, %s}}' % Z3],
         "deepspeed.scheduler.params.total_num_steps is missing: WarmupDecayLR needs it"),
    ],
    "scaling": [
        (["scaling.num_workers=0"], "scaling.num_workers must be an integer >= 1 or a list of integers or null, got 0"),
        (["scaling.num_workers=3", 'deepspeed={"train_batch_size": 8, %s}}' % Z3],
         "deepspeed.train_batch_size=8 is not divisible by gradient_accumulation_steps=1 x world size 3"),
        (["scaling.cpus_per_worker=0"], "scaling.cpus_per_worker must be a number > 0, got 0"),
        (["scaling.placement_strategy=pack"], "scaling.placement_strategy must be PACK, SPREAD, STRICT_SPREAD or STRICT_PACK"),
        (["scaling.use_gpu=false", 'deepspeed={"fp16": {"enabled": true}, %s}}' % Z3],
         "deepspeed.fp16.enabled=true needs GPUs"),
        (["scaling.num_workers=4", "data.num_shards=6"], "data.num_shards=6 is not divisible by the 4 workers"),
    ],
    "elastic range (scaling.num_workers: [min, max])": [
        (["scaling.num_workers=[4, 2]"], "scaling.num_workers=[4, 2] has the minimum 4 above the maximum 2: write [2, 4]"),
        (["scaling.num_workers=[0, 2]"], "scaling.num_workers=[0, 2] has the minimum 0: an elastic range needs at least 1"),
        (["scaling.num_workers=[2, 4]", "data.num_shards=8", "training.micro_batch_size_per_gpu=2",
          "deepspeed.train_batch_size=24"], "scaling.num_workers=[2, 4]: data.num_shards=8 is not divisible by world "
                                            "size(s) [3]"),
        (["scaling.num_workers=[2, 4]", "data.num_shards=12", "training.micro_batch_size_per_gpu=8",
          "deepspeed.train_batch_size=48"], "train_batch_size=48 with micro-batch 8 needs a whole gradient "
                                            "accumulation at every world size, and [4] do(es) not divide 6"),
        (["scaling.num_workers=[2, 3]"], "scaling.num_workers=[2, 3]: an elastic run needs data.num_shards"),
        (["scaling.num_workers=[2, 3]", "scaling.resize_interval_s=-1"], "scaling.resize_interval_s must be a number >= 0"),
        # Ray Train starts as many workers as the CPUs hold: the 1 that starts takes the only CPU, and Ray Data waits
        (["cluster.num_cpus=1", "scaling.num_workers=[1, 2]", "data.num_shards=2", "scaling.use_gpu=false"],
         "scaling.num_workers=[1, 2] starts as many workers as the cluster's 1 CPUs hold, 1 x "
         "scaling.cpus_per_worker=1, which leave 0 for Ray Data, which then hangs"),
        # the shard count every size divides has 4,300+ digits (was a ValueError printing it)
        (["scaling.num_workers=[1, 10000]", "data.num_shards=12", "scaling.use_gpu=false"],
         "data.num_shards=12 is not divisible by world size(s) [5, 7, 8, 9, 10, 11, 13, ...]: for a range this wide "
         "the smallest such count is over 100,000: narrow it"),
        (["scaling.num_workers=[1, 10000]", "deepspeed.train_batch_size=64", "training.micro_batch_size_per_gpu=1",
          "scaling.use_gpu=false"], "and [3, 5, 6, 7, 9, 10, 11 and 9986 more] do(es) not divide 64: no practical "
                                    "train_batch_size suits every size of a range this wide"),
    ],
    # (a dry run holds a run to this machine where the config says it is local: cluster.address=local, cluster.num_cpus)
    "a placement the local cluster can never make (Ray Train would wait for it forever)": [
        (["cluster.address=local", "cluster.num_cpus=2", "scaling.cpus_per_worker=2", "scaling.use_gpu=false"],
         "2 workers x scaling.cpus_per_worker=2 need 4 CPUs, and the local Ray cluster this run starts (one node: "
         "cluster.num_cpus=2"),  # "local" is Ray's new local cluster: raytrain's, which cluster.num_cpus sizes
        (["cluster.address=local", "scaling.placement_strategy=STRICT_SPREAD", "scaling.use_gpu=false"],
         "scaling.placement_strategy=STRICT_SPREAD puts each of 2 workers on a node of its own, and the local Ray "
         "cluster this run starts"),
        (["cluster.address=local", "scaling.accelerator_type=NO-SUCH-GPU"],
         "scaling.accelerator_type='NO-SUCH-GPU': no node of the local Ray cluster this run starts (one node: "),
    ],
    "checkpoint": [
        (["checkpoint.storage_path=FILES/afile"], "checkpoint.storage_path=FILES/afile: it is a file, not a directory"),
        (["checkpoint.storage_path=nofs://bucket/runs", "checkpoint.name=r1"],
         "checkpoint.storage_path=nofs://bucket/runs: pyarrow has no filesystem for the scheme nofs://"),
        (["checkpoint.storage_path=az://container/runs"], "pyarrow has no filesystem for the scheme az://"),
        (["checkpoint.storage_path=s3:/bucket/runs"], "checkpoint.storage_path=s3:/bucket/runs: a URI takes two "
                                                      "slashes after its scheme: write s3://bucket/runs"),
        (["checkpoint.storage_path=FILES/afile/runs"], "checkpoint.storage_path=FILES/afile/runs: FILES/afile, on its path, "
                                                       "is a file"),
        (["checkpoint.resume_from=FILES/adir"], "checkpoint.resume_from=FILES/adir is not a raytrain checkpoint"),
        (["--resume-from", "FILES/missing"], "checkpoint.resume_from=FILES/missing is not a raytrain checkpoint"),
        (["checkpoint.resume_from=nofs://bucket/run/checkpoint_step_00000010"], "checkpoint.resume_from=nofs://bucket/"
                                                                                "run/checkpoint_step_00000010: cannot read it"),
        (["checkpoint.export_dir=FILES/afile"], "checkpoint.export_dir=FILES/afile: it is a file"),
        (["checkpoint.num_to_keep=0"], "checkpoint.num_to_keep must be an integer >= 1, got 0"),
        (["checkpoint.every_n_steps=-5"], "checkpoint.every_n_steps must be an integer >= 0, got -5"),
        (["checkpoint.name=a/b"], "checkpoint.name='a/b' is not one directory name"),
    ],
    "network": [
        (["network.env.NCLL_DEBUG=INFO"], "network.env.NCLL_DEBUG: only NCCL_*, GLOO_*, FI_* variables belong here"),
        (["network.env.NCCL_IB_DISABLE=true"], "network.env.NCCL_IB_DISABLE must be a string or a number, got true"),
        (["network.preflight=2"], "network.preflight must be true or false, got 2"),
        (["network.env=[NCCL_DEBUG]"], "network.env must be a mapping"),
        (["network.env.NCCL_IB_HCAA=mlx5_0"], "network.env.NCCL_IB_HCAA: NCCL reads no such variable (it would be "
                                              "ignored); did you mean NCCL_IB_HCA?"),
        (["network.env.NCCL_NET_GDR_LVL=PHB"], "did you mean NCCL_NET_GDR_LEVEL?"),
    ],
    "tracking": [  # refused on the driver, not by rank 0 (a retried worker failure); --dry-run too
        (["tracking.mlflow_tracking_uri=http://127.0.0.1:9"], "tracking.mlflow_tracking_uri=http://127.0.0.1:9: MLflow "
                                                              "cannot use it (API request to http://127.0.0.1:9/"),
    ],
    "cluster address": [
        (["cluster.address=head:abc"], "cluster.address='head:abc' is not a Ray address: write HOST:PORT"),
        (["cluster.address=head"], "cluster.address='head' is not a Ray address"),
        (["cluster.address=head:99999"], "cluster.address='head:99999' is not a Ray address"),
        (["cluster.address=http://head:8265"], "cluster.address='http://head:8265' is the dashboard's address"),
        (["cluster.address=grpc://head:10001"], "cluster.address='grpc://head:10001' is not a Ray address"),
        (["cluster.num_cpus=0"], "cluster.num_cpus must be an integer >= 1 or null, got 0"),
    ],
    "data (first records)": [
        (["data.path=FILES/missing"], "data.path: FILES/missing does not exist"),
        (["data.path=FILES/not_json.jsonl"], "data.path: FILES/not_json.jsonl line 1 is not valid JSON"),
        (["data.path=FILES/body.jsonl"], "data.text_column='text' is not a key of the records in FILES/body.jsonl"),
        (["data.path=FILES/number.jsonl"], "data.text_column='text' holds int values in FILES/number.jsonl line 1"),
        (["data.path=FILES/array.json"], "data.text_column='text' is not a key of the records in FILES/array.json"),
        (["data.path=FILES/bad_utf8.txt", "data.invalid_utf8=error"], "FILES/bad_utf8.txt: invalid UTF-8 at byte 9"),
    ],
}


# These tests assert that a refused run never calls ray.init (tests/conftest.py: no_ray_driver).
pytestmark = pytest.mark.usefixtures("no_ray_driver")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad_input")
    (d / "adir").mkdir()
    for step in (2, 4):  # a run's directory as the worker and Ray Train leave it (the shards left out)
        (d / "arun" / f"checkpoint_step_{step:08d}").mkdir(parents=True)
        (d / "arun" / f"checkpoint_step_{step:08d}" / "raytrain.json").write_text('{"step": %d}' % step)
    (d / "arun" / "model").mkdir()
    (d / "afile").write_text("not a directory\n")
    (d / "latin1.yaml").write_bytes("training:\n  max_steps: 5  # caf\xe9\n".encode("latin-1"))
    (d / "broken.yaml").write_text("training:\n  max_steps: [1,\n")
    (d / "list.yaml").write_text("- training\n- data\n")
    (d / "rayup.yaml").write_text("cluster_name: gpus\nprovider: {type: azure}\nhead_node_type: head\n")
    (d / "commented.yaml").write_text("training:\n  # max_steps: 5\n")
    (d / "twice.yaml").write_text("training:\n  max_steps: 5\ndata: {}\ntraining:\n  seed: 1\n")
    (d / "twice_nested.yaml").write_text("training:\n  max_steps: 5\n  max_steps: 6\n")
    (d / "twice.json").write_text('{"zero_optimization": {"stage": 3},\n "zero_optimization": {"stage": 2}}')
    (d / "broken.json").write_text('{"train_batch_size": 8,}')
    (d / "list.json").write_text("[1, 2]")
    (d / "not_json.jsonl").write_text("{'text': 'single quotes'}\n")
    (d / "body.jsonl").write_text('{"body": "a document"}\n')
    (d / "number.jsonl").write_text('{"text": 5}\n')
    (d / "array.json").write_text('[{"body": "a document"}, {"body": "another"}]')
    (d / "bad_utf8.txt").write_bytes(b"fine\nnot \xff fine\n")
    return d


def rows() -> list:
    return [pytest.param(argv, needle, id=f"{name}: {' '.join(argv)[:60]}")
            for name, examples in CLASSES.items() for argv, needle in examples]


def snapshot(root) -> list[tuple[str, int]]:
    return sorted((os.path.relpath(os.path.join(p, f), root), os.path.getsize(os.path.join(p, f)))
                  for p, dirs, fs in os.walk(root) for f in fs + dirs)


def one_error_line(capsys, rc: int, needle: str) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("raytrain: error: "), err
    assert needle in lines[0], err
    assert "Traceback" not in err and out == "", out
    return lines[0]


@pytest.mark.parametrize("mode", ["--dry-run", "real run"])
@pytest.mark.parametrize("argv, needle", rows())
def test_each_class_of_bad_input_is_one_line_and_exit_2(argv, needle, mode, files, tmp_path, capsys, monkeypatch):
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)
    storage = tmp_path / "runs"  # must not be created: a refused run writes nothing
    argv = [a.replace("FILES", str(files)) for a in argv]
    before = snapshot(files)
    own = [] if any(a.startswith("checkpoint.storage_path=") for a in argv) else [f"checkpoint.storage_path={storage}"]
    rc = train_main([*(["--dry-run"] if mode == "--dry-run" else []), *own, *argv])
    one_error_line(capsys, rc, needle.replace("FILES", str(files)))
    assert snapshot(files) == before and not storage.exists() and os.listdir(tmp_path) == []
    assert not ray.is_initialized()  # refused before ray.init


def test_the_environments_ray_address_is_checked_like_cluster_address(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")  # the dashboard's: what `ray job submit` takes
    rc = train_main(["--dry-run", f"checkpoint.storage_path={tmp_path / 'runs'}"])
    one_error_line(capsys, rc, "the environment's RAY_ADDRESS='http://127.0.0.1:8265' is the dashboard's address")


@pytest.mark.parametrize("tool, argv", [(plan_main, ["scaling.num_workers=16"]),
                                        (preflight_main, ["--no-use-gpu", "--num-workers", "2"])])
def test_plan_and_preflight_check_the_environments_ray_address_too(tool, argv, monkeypatch, capsys):
    import ray

    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")  # was ray.init's 27-line ValueError, exit 1
    one_error_line(capsys, tool(argv), "the environment's RAY_ADDRESS='http://127.0.0.1:8265' is the dashboard's")
    assert not ray.is_initialized()


def test_a_run_that_does_not_fit_is_refused_with_the_planners_line(capsys, tmp_path):
    rc = train_main(["--dry-run", "--gpu-memory-gib", "1", "--host-memory-gib", "64", "scaling.use_gpu=true",
                     "scaling.num_workers=2", f"checkpoint.storage_path={tmp_path / 'runs'}",
                     'model.config={"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, '
                     '"num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000}'])
    line = one_error_line(capsys, rc, "this run needs ")
    assert "per GPU" in line and "the GPUs have 1.0 GiB" in line


TOOLS = [
    (plan_main, ["--gpu-memory-gib", "abc"], "argument --gpu-memory-gib: must be a number, got 'abc'"),
    (plan_main, ["--gpu-memory-gib", "-8"], "argument --gpu-memory-gib: must be > 0, got -8"),
    (plan_main, ["--gpus-per-node", "0"], "argument --gpus-per-node: must be >= 1, got 0"),
    (plan_main, ["--gpus-per-node", "2.5"], "argument --gpus-per-node: must be an integer, got '2.5'"),
    (plan_main, ["--gpu-mem", "80"], "unrecognized arguments: --gpu-mem ("),  # not taken for --gpu-memory-gib
    (plan_main, ["training.warmup_steps=-1"], "training.warmup_steps must be an integer >= 0"),
    (plan_main, ["--config", "FILES/adir"], "config file FILES/adir is a directory"),
    (plan_main, ["--config", "FILES/rayup.yaml"], "config file FILES/rayup.yaml is a Ray cluster file (for ray up)"),
    (preflight_main, ["--config", "FILES/rayup.yaml"], "config file FILES/rayup.yaml is a Ray cluster file"),
    (plan_main, ["--config", "FILES/list.yaml", "--config", "FILES/twice.yaml"], "--config is given 2 times"),
    (plan_main, ["training.max_steps=2", "training.max_steps=3"], "training.max_steps is given twice"),
    (plan_main, ["--gpu-memory-gib", "1e400"], "argument --gpu-memory-gib: must be a finite number, got 1e400"),
    (preflight_main, ["--iters", "0"], "argument --iters: must be >= 1, got 0"),
    (preflight_main, ["--timeout-s", "-1"], "argument --timeout-s: must be > 0, got -1"),
    (preflight_main, ["--num-workers", "two"], "argument --num-workers: must be an integer, got 'two'"),
    (preflight_main, ["--min-ib-busbw-gbs", "nan"],
     "argument --min-ib-busbw-gbs: must be a finite number >= 0, got nan"),
    (plan_main, ["--gpu-memory-gib", "inf"], "argument --gpu-memory-gib: must be a finite number > 0, got inf"),
    (preflight_main, ["--sizes", "1Q"], "--sizes: '1Q' is not a size"),
    (preflight_main, ["network.env.FOO=1"], "network.env.FOO: only NCCL_*, GLOO_*, FI_* variables"),
    (preflight_main, ["network.env.NCCL_SOCKET_IFNAM=eth0"], "did you mean NCCL_SOCKET_IFNAME?"),
    (preflight_main, ["--config", "FILES/list.yaml", "--config", "FILES/twice.yaml"], "--config is given 2 times"),
    (preflight_main, ["--num-workers", "2", "scaling.num_workers=4"], "scaling.num_workers is given twice"),
    (export_main, ["FILES/adir", "FILES/out"], "the checkpoint=FILES/adir is not a raytrain checkpoint"),
    (export_main, ["FILES/adir", "FILES/afile"], "OUT_DIR=FILES/afile: it is a file"),
    (export_main, ["FILES/adir", "FILES/out", "--max-shard-size", "5XB"], "argument --max-shard-size: '5XB'"),
    (export_main, ["FILES/adir", "FILES/out", "--max-shard-size=-1GB"], "must be a positive size"),
    (export_main, ["FILES/adir"], "the following arguments are required: out_dir"),
]


@pytest.mark.parametrize("tool, argv, needle", TOOLS, ids=[f"{t.__module__.split('.')[-1]} {' '.join(a)}"
                                                           for t, a, _ in TOOLS])
def test_the_other_command_lines_bad_flags_are_one_line_and_exit_2(tool, argv, needle, files, capsys, monkeypatch):
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    before = snapshot(files)
    rc = tool([a.replace("FILES", str(files)) for a in argv])
    one_error_line(capsys, rc, needle.replace("FILES", str(files)))
    assert snapshot(files) == before and not ray.is_initialized()


def test_a_real_run_is_refused_by_the_process(files, tmp_path):
    """The same at the process level: the exit code, one stderr line, no Ray started (no Ray log line)."""
    ds = json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}})
    p = subprocess.run([sys.executable, "-m", "raytrain.main", f"checkpoint.storage_path={tmp_path / 'runs'}",
                        f"deepspeed={ds}"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and p.stderr.startswith("raytrain: error: deepspeed."), \
        p.stderr
    assert "offload_param.device" in p.stderr and p.stdout == "" and not (tmp_path / "runs").exists()
