"""Modal entrypoint: package nanopt, run the same torchrun command a user would type, keep results on a Volume.

    modal run modal_app.py --config configs/1b.yaml [--gpus 8] [--gpu-type H100] [--run-name NAME] [--prepare]

No training logic lives here. The training function writes the config into the run directory on the Volume and
launches torchrun from the Volume root, so every relative path in the config (run.dir, data.dir) lands on the Volume.
Modal's retries resume from the newest complete checkpoint; a failure that would only repeat itself (bad input,
divergence, a crash with no progress) is reported, not retried, and `modal run` exits with its code."""
from __future__ import annotations

import contextlib
import copy
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import modal

from nanopt.errors import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_PREEMPTED, EXIT_STATUS_ENV  # stdlib only: cheap at import

REPO = Path(__file__).resolve().parent
APP_NAME = "nanopt"
VOLUME_NAME = "nanopt"
VOLUME_PATH = "/vol"  # where the Volume is mounted in every container; tests point it at a tmp dir
RUN_CONFIG_NAME = "modal_config.yaml"  # nanopt itself writes the resolved config.yaml next to it

# Training may be served an H200 for an "H100" (same price; MFU stays honest: the peak is the detected device's).
# Benches report H100 numbers, so they ask for exactly an H100 ("!": no upgrade).
TRAIN_GPU = "H100"
TRAIN_GPUS = 8
EVAL_GPU = "L40S"  # 48 GB: enough to evaluate the 1B model in bf16, at a fraction of an H100's price
BENCH_GPU = "H100!"
# The benches that mean something on a GPU (ddp.py and prepare.py measure CPU cores).
GPU_BENCHES = ("vs_hf", "ladder", "gpu_check")  # gpu_check: the CUDA path verified (docs/results.md "GPU: one H100")
PREPARE_CPUS = 32.0
DAY_S = 24 * 60 * 60  # Modal's longest function timeout
TRAIN_TIMEOUT_S = DAY_S
# The trainer is told to stop (checkpoint, exit 75) this long before the function's timeout: the step in progress,
# the final checkpoint (14.8 GB for configs/1b.yaml: ~5 min at 50 MB/s), torchrun's shutdown and the Volume commit.
TIME_LIMIT_MARGIN_S = 15 * 60
COMMIT_EVERY_S = 10 * 60  # make checkpoints and metrics visible to other containers while training runs
MASTER_PORT = 29500
# Multi-node (experimental): NANOPT_MODAL_NODES=2 modal run modal_app.py ... makes a cluster of that many containers,
# each with the requested GPUs (the size is fixed when the function is decorated).
NODES = int(os.environ.get("NANOPT_MODAL_NODES", "1") or 1)

# The stack bench/gpu_check.py measured on an H100 SXM (bench/results/gpu_check_h100_shipped.json: Python 3.12.3,
# torch 2.11.0+cu130, cuDNN 9.19, NCCL 2.28.9): configs/1b.yaml at 51.3% MFU with SDPA's cuDNN attention.
PYTHON_VERSION = "3.12"
TORCH_VERSION = "2.11.0"
# torch from PyPI, whose 2.11.0 Linux wheel is that CUDA 13.0 build. Not from PyTorch's cu130 index: an index_url
# replaces PyPI for the whole install, and that index lacks cuda-bindings>=13.0.3 (pytorch/pytorch#172926).
TORCH_PACKAGE = f"torch=={TORCH_VERSION}"
TORCHAO_VERSION = "0.18.0"  # train.fp8 (torchao's float8 training); made for torch >= 2.11
PIP_PACKAGES = [
    f"torchao=={TORCHAO_VERSION}", "numpy>=1.24", "pyyaml>=6", "safetensors>=0.4", "matplotlib>=3.7", "scipy>=1.10",
    "tqdm>=4.60", "tensorboard>=2.14", "torch-tb-profiler>=0.4", "datasets>=2.19", "transformers>=4.44",
    "tokenizers>=0.19", "tiktoken>=0.7", "wandb", "packaging",
    "lm-eval>=0.4.13",  # downstream tasks (`nanopt eval --tasks`) and gpu_check --quick's harness section
]
# flash-attn is left out: no wheel for torch 2.11, and `attention: auto` picks SDPA anyway (never measured). To
# measure it, build the image with a wheel for this torch, CUDA and Python: NANOPT_MODAL_FLASH_ATTN_WHEEL=URL.
FLASH_ATTN_WHEEL = os.environ.get("NANOPT_MODAL_FLASH_ATTN_WHEEL", "")

# NCCL's InfiniBand/RoCE transport dlopens libibverbs and the NIC's verbs provider (mlx5: ibverbs-providers); without
# them a multi-node run silently falls back to TCP. gcc: Triton builds its kernel launchers with it (torch.compile).
APT_PACKAGES = ["libibverbs1", "ibverbs-providers", "gcc"]


def pip_layers(flash_attn_wheel: str = "") -> list[list[str]]:
    """The image's pip installs, one layer each, plain PyPI (see TORCH_PACKAGE); torch alone first, so its
    gigabytes stay cached when the rest changes."""
    layers = [[TORCH_PACKAGE], list(PIP_PACKAGES)]
    return layers + [[flash_attn_wheel]] if flash_attn_wheel else layers


def build_image() -> modal.Image:
    """The measured stack, nanopt's dependencies, and nanopt's source, configs and benches."""
    built = modal.Image.debian_slim(python_version=PYTHON_VERSION).apt_install(*APT_PACKAGES)
    for packages in pip_layers(FLASH_ATTN_WHEEL):
        built = built.pip_install(*packages)
    # Downloaded tokenizers and datasets, and the embedded corpus's shards, persist across runs.
    env = {"HF_HOME": f"{VOLUME_PATH}/hf", "NANOPT_CACHE": f"{VOLUME_PATH}/cache/nanopt", "PYTHONUNBUFFERED": "1"}
    # Last: local sources are mounted at container start, so editing nanopt never rebuilds the image.
    return (built.env(env).add_local_python_source("nanopt")
            .add_local_dir(REPO / "configs", "/root/configs")
            .add_local_dir(REPO / "bench", "/root/bench"))


image = build_image()
app = modal.App(APP_NAME, image=image)
volume = modal.Volume.from_name(VOLUME_NAME, create_if_missing=True)
hf_secret = modal.Secret.from_name("huggingface", required_keys=["HF_TOKEN"])
wandb_secret = modal.Secret.from_name("wandb", required_keys=["WANDB_API_KEY"])  # added when log.wandb is on
# Modal retries when the function raises, which `finish` does only for an attempt preempted or with progress.
retries = modal.Retries(max_retries=10, initial_delay=0.0, backoff_coefficient=1.0)

# Host reserved per GPU (a rank's loop, data loader, compile workers, CUDA context, pinned batches) plus, once, rank 0's
# host copy of a checkpoint (15 GB for 1b). Unreserved, Modal guarantees a fraction of a core.
CPU_PER_GPU = 4.0
MEMORY_PER_GPU_MIB = 12 * 1024
MEMORY_BASE_MIB = 16 * 1024


def train_resources(gpus: int) -> dict[str, Any]:
    """cpu= and memory= (MiB) for a training container with `gpus` GPUs."""
    return {"cpu": CPU_PER_GPU * gpus, "memory": MEMORY_BASE_MIB + MEMORY_PER_GPU_MIB * gpus}


TRAIN_OPTIONS: dict[str, Any] = dict(gpu=f"{TRAIN_GPU}:{TRAIN_GPUS}", **train_resources(TRAIN_GPUS),
                                     volumes={VOLUME_PATH: volume}, secrets=[hf_secret], timeout=TRAIN_TIMEOUT_S,
                                     retries=retries)
# One GPU, but more host than a training rank: its many short runs each compile, and its 1B runs hold a 15 GB host
# copy of their checkpoint. The Volume keeps what the bench writes (gpu_check.json).
BENCH_CPUS = 16.0
BENCH_OPTIONS: dict[str, Any] = dict(gpu=BENCH_GPU, cpu=BENCH_CPUS, memory=64 * 1024, volumes={VOLUME_PATH: volume},
                                     timeout=2 * 60 * 60)
BENCH_RESULTS_DIR = "bench"  # on the Volume: bench/<name>-<UTC time>/
BENCHES_WITH_OUT = ("gpu_check",)  # the benches that take `--out DIR` and write their results there


# ---------------------------------------------------------------- pure helpers (tested offline)
def torchrun_command(config_path: str, nproc: int, nnodes: int = 1, node_rank: int = 0,
                     master_addr: str = "") -> list[str]:
    """The launch command, exactly as a user would type it on one machine (or on each node of a cluster)."""
    if nnodes == 1:
        launcher = ["--standalone"]
    else:
        launcher = [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={master_addr}",
                    f"--master-port={MASTER_PORT}"]
    return ["torchrun", *launcher, f"--nproc-per-node={nproc}", "-m", "nanopt.main", "--config", config_path]


def eval_command(run_dir: str, split: str) -> list[str]:
    """`nanopt eval RUN --split SPLIT`; the image has nanopt's source but not its console script."""
    return [sys.executable, "-m", "nanopt.cli", "eval", run_dir, "--split", split]


def prepare_command(config_path: str, workers: int = 0) -> list[str]:
    """`nanopt prepare --config FILE`, with `--prepare.workers=N` when given: inside a Modal container
    os.cpu_count() can report the host's cores rather than the ones the function asked for."""
    cmd = [sys.executable, "-m", "nanopt.cli", "prepare", "--config", config_path]
    return cmd + [f"--prepare.workers={workers}"] if workers else cmd


def bench_command(name: str, args: str = "", out_dir: str = "") -> list[str]:
    """`python bench/NAME.py ARGS [--out OUT_DIR]` (REPO is /root in the container, where bench/ is mounted)."""
    if name not in GPU_BENCHES:
        raise ValueError(f"no GPU bench {name!r}; choose one of: {', '.join(GPU_BENCHES)}")
    out = ["--out", out_dir] if out_dir else []
    return [sys.executable, str(REPO / "bench" / f"{name}.py"), *shlex.split(args), *out]


def bench_out_dir(name: str, args: str, stamp: str) -> str:
    """Where on the Volume (relative to its root) bench NAME writes its results: `bench/NAME-STAMP` for a bench that
    takes --out, "" for one that does not or when ARGS give their own --out (theirs wins)."""
    given = any(a == "--out" or a.startswith("--out=") for a in shlex.split(args))
    return f"{BENCH_RESULTS_DIR}/{name}-{stamp}" if name in BENCHES_WITH_OUT and not given else ""


def run_dir_for(run_name: str) -> str:
    """A run directory relative to the Volume root (the working directory of every launched command)."""
    return f"runs/{run_name}"


def check_config(path: str, world_size: int, run_name: str = "", nodes: int = 1) -> tuple[str, Any]:
    """(YAML for the Volume, Config): the config loaded and validated as nanopt will for this world over `nodes`,
    run.dir on the Volume, fsdp across nodes made hsdp. Raises nanopt's ConfigError."""
    from nanopt.config import ConfigError, load_config, resolve, to_yaml, validate

    if world_size < 1:
        raise ConfigError(f"--gpus must be at least 1, got {world_size}.")
    cfg = load_config(path)
    if run_name:
        cfg.run.name = run_name
    cfg.run.dir = run_dir_for(cfg.run.name)
    sharded_across_nodes(cfg, nodes, world_size // nodes)
    validate(cfg)
    # the batch must divide over this many GPUs, hsdp's groups over the nodes: check before paying
    resolve(copy.deepcopy(cfg), world_size, world_size // nodes)
    return to_yaml(cfg), cfg


def sharded_across_nodes(cfg: Any, nodes: int, gpus: int) -> None:
    """runtime.parallel=fsdp on several nodes of several GPUs becomes hsdp with a shard group per node, said in one
    line: FSDP across nodes would gather every block's weights over the network for each forward and backward; HSDP
    gathers over NVLink and sends one all-reduce of the gradient shards across nodes per step (for memory: a whole
    copy per node)."""
    if nodes < 2 or gpus < 2 or cfg.runtime.parallel != "fsdp":
        return
    cfg.runtime.parallel, cfg.runtime.shard_group_size = "hsdp", gpus
    print(f"modal_app: runtime.parallel fsdp on {nodes} nodes runs as hsdp: each node's {gpus} GPUs shard the "
          f"model (runtime.shard_group_size: {gpus}) and the {nodes} nodes are its replicas, so only gradients "
          f"cross the network", flush=True)


def write_run_config(config_yaml: str, run_name: str) -> str:
    """Write the config into the run directory on the Volume; return its path."""
    run_dir = Path(VOLUME_PATH) / run_dir_for(run_name)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RUN_CONFIG_NAME
    path.write_text(config_yaml)
    return str(path)


def rank_thread_env(cpus_per_rank: int) -> dict[str, str]:
    """Thread settings per rank, sized to the cores reserved per rank, so ranks do not oversubscribe them. PASSIVE:
    nanopt's train makes idle OpenMP threads spin, but a GPU rank's host threads mostly wait. Inductor's compile
    workers and a lone process's OpenMP pool would otherwise size themselves by os.cpu_count(), the host's cores."""
    cores = str(max(1, cpus_per_rank))
    return {"OMP_NUM_THREADS": cores, "OMP_WAIT_POLICY": "PASSIVE", "TORCHINDUCTOR_COMPILE_THREADS": cores}


def launch_env(cpus_per_rank: int = 0) -> dict[str, str]:
    """The environment for launched commands: they run from the Volume root and must still import nanopt. With
    `cpus_per_rank`, also rank_thread_env's settings, each unless this environment already sets it (yours win)."""
    import nanopt

    source_root = str(Path(nanopt.__file__).resolve().parent.parent)  # /root in the container
    threads = rank_thread_env(cpus_per_rank) if cpus_per_rank else {}
    return {**threads, **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (source_root, os.environ.get("PYTHONPATH")) if p)}


def lock_env() -> dict[str, str]:
    """The run directory's lock on a Volume: other containers see its heartbeat only at each commit, so it
    expires only after two commit intervals; Modal's retries of one call share the call id, so a retry takes
    over the lease its killed attempt left, while another `modal run` on the same run name is refused."""
    from nanopt.lock import LOCK_EXPIRES_ENV, LOCK_OWNER_ENV

    try:
        call_id = modal.current_function_call_id() or ""
    except Exception:  # outside a Modal container (tests, .local())
        call_id = ""
    return {LOCK_EXPIRES_ENV: str(2 * COMMIT_EVERY_S + 60), LOCK_OWNER_ENV: call_id}


def run_forwarding_signals(cmd: list[str], cwd: str, env: Optional[dict[str, str]] = None) -> tuple[int, Optional[int]]:
    """Run cmd to completion, passing SIGINT/SIGTERM on (Modal preempts with SIGINT and ~30 s of grace: nanopt's cue
    to checkpoint); return (exit code, forwarded signal or None). Its own session: it hears each signal once."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True)
    forwarded: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        forwarded.append(signum)
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():  # Python only delivers signals there
        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait(), (forwarded[0] if forwarded else None)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if proc.poll() is None:  # leaving early (the input was cancelled): do not orphan the workers
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


@contextlib.contextmanager
def committing(every_s: float) -> Iterator[None]:
    """Commit the Volume every `every_s` seconds while the block runs, and once when it ends."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            try:
                volume.commit()
            except Exception as e:  # a failed intermediate commit must not stop training
                print(f"modal_app: volume commit failed ({e}); will retry", flush=True)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        volume.commit()


class RetryAttempt(RuntimeError):
    """Raised out of the training function so that Modal runs another attempt (which nanopt resumes); `exit_code`
    is what `modal run` exits with if this was the last attempt Modal allowed."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self) -> tuple[Any, tuple[str, int]]:  # Modal pickles it back to the caller
        return type(self), (str(self), self.exit_code)


def time_limit_args(user_limit_s: float, timeout_s: float, elapsed_s: float) -> list[str]:
    """`--run.time_limit_s=...` so the trainer checkpoints and exits 75 before Modal's timeout: the timeout less the
    margin and the time already spent. A smaller limit of the config's stands; a larger one is lowered."""
    budget = max(timeout_s - TIME_LIMIT_MARGIN_S - elapsed_s, 60.0)  # a limit <= 0 would mean "none"
    if 0 < user_limit_s <= budget:
        return []
    return [f"--run.time_limit_s={budget:.0f}"]


def worker_exit_codes(path: Path) -> list[int]:
    """The codes nanopt's workers recorded in NANOPT_EXIT_STATUS_FILE ("RANK CODE" lines), if any."""
    try:
        return [int(line.split()[1]) for line in path.read_text().splitlines() if len(line.split()) == 2]
    except (OSError, ValueError):
        return []


def finish(what: str, run_name: str, code: int, forwarded: Optional[int], worker_codes: tuple[int, ...] = (),
           nproc: int = 1, progressed: bool = False) -> dict[str, Any]:
    """An attempt's outcome as a result (not retried) or a RetryAttempt (Modal retries, nanopt resumes).

    `code`: torchrun's (1 for any failed worker); `worker_codes`: what nanopt's workers recorded (a crashed one
    nothing, the ones torchrun then stops 75, so "preempted" needs all `nproc` to say 75). `progressed`: a newer
    complete checkpoint exists. Retried: a preemption and a crash after progress. Not retried: bad input (2),
    divergence (3) and a crash without progress (an OOM at step 0, broken NCCL), which would only repeat."""
    result = {"run_dir": f"{VOLUME_PATH}/{run_dir_for(run_name)}", "exit_code": code}
    if forwarded is not None:  # the container is being preempted: this attempt must not count as done
        raise RetryAttempt(f"{what} was interrupted by signal {forwarded}; the next attempt resumes from the "
                           f"newest checkpoint in {result['run_dir']}.", EXIT_PREEMPTED)
    final = [c for c in (code, *worker_codes) if c in (EXIT_BAD_INPUT, EXIT_DIVERGED)]
    if final:
        # A retry would fail the same way (same config and data; a deterministic resume diverges again).
        reason = "rejected its config or data" if EXIT_BAD_INPUT in final else "stopped on a non-finite loss"
        result["exit_code"] = final[0]
        result["error"] = f"{what} {reason} (exit code {final[0]}); see the log above. Not retried."
        return result
    if code == 0:
        return result
    preempted = code == EXIT_PREEMPTED or (len(worker_codes) >= nproc and set(worker_codes) == {EXIT_PREEMPTED})
    if preempted:
        raise RetryAttempt(f"{what} stopped resumably (exit code {EXIT_PREEMPTED}: preempted or past "
                           f"run.time_limit_s); the next attempt resumes from the newest checkpoint in "
                           f"{result['run_dir']}.", EXIT_PREEMPTED)
    if progressed:
        raise RetryAttempt(f"{what} exited with code {code} after saving a newer checkpoint; Modal retries and "
                           f"nanopt resumes from the newest checkpoint in {result['run_dir']}.", code)
    result["exit_code"] = code if 0 < code < 256 else 1  # a negative code is a signal; exit statuses are 0-255
    result["error"] = (f"{what} exited with code {code} without saving a newer checkpoint than it started from, so a "
                       f"retry would most likely fail the same way (e.g. out of memory, NCCL); see the log above. "
                       f"Not retried: fix the cause and re-run the same command to resume.")
    return result


# ---------------------------------------------------------------- Modal functions
def _train(config_yaml: str, run_name: str, gpus: int, nnodes: int = 1, node_rank: int = 0,
           master_addr: str = "", timeout_s: float = TRAIN_TIMEOUT_S) -> dict[str, Any]:
    from nanopt.config import load_config
    from nanopt.training.checkpoint import newest_checkpoint, step_of

    started = time.monotonic()  # Modal's timeout runs from here (near enough: the margin covers the rest)
    config_path = write_run_config(config_yaml, run_name)
    run_dir = Path(VOLUME_PATH) / run_dir_for(run_name)
    newest, _ = newest_checkpoint(run_dir)  # verified newest first: older checkpoints are not read
    before = step_of(newest) if newest else -1
    limit = time_limit_args(load_config(config_path).run.time_limit_s, timeout_s, time.monotonic() - started)
    cmd = torchrun_command(config_path, gpus, nnodes, node_rank, master_addr) + limit
    print("modal_app: " + " ".join(cmd), flush=True)
    status = Path(tempfile.mkdtemp(prefix="nanopt-exit-")) / "codes"  # in the container, not on the Volume
    env = {**launch_env(int(CPU_PER_GPU)), EXIT_STATUS_ENV: str(status), **lock_env()}
    if node_rank != 0:  # only node 0 writes results (nanopt's rank 0), so only it commits
        code, forwarded = run_forwarding_signals(cmd, VOLUME_PATH, env)
    else:
        volume.commit()
        with committing(COMMIT_EVERY_S):
            code, forwarded = run_forwarding_signals(cmd, VOLUME_PATH, env)
    # Other nodes never see node 0's new checkpoints in their view of the Volume: they cannot judge progress,
    # so they leave the call to node 0 (counting as progressed keeps them from ending the run on their own).
    progressed = node_rank != 0 or newest_checkpoint(run_dir, newer_than=before)[0] is not None
    return finish("training", run_name, code, forwarded, tuple(worker_exit_codes(status)), gpus, progressed)


@app.function(**TRAIN_OPTIONS)
def train(config_yaml: str, run_name: str, gpus: int = TRAIN_GPUS) -> dict[str, Any]:
    """Train on one machine with `gpus` GPUs (set the GPU spec to match with .with_options(gpu=...))."""
    return _train(config_yaml, run_name, gpus)


if NODES > 1 or not modal.is_local():
    # Defined only when asked for, so a plain `modal run` never registers a clustered function. Inside a
    # container it is always defined (the server holds the real cluster size), so any app can find it.
    @app.function(**TRAIN_OPTIONS)
    @modal.clustered(size=max(NODES, 2), rdma=True)
    def train_multinode(config_yaml: str, run_name: str, gpus: int = TRAIN_GPUS) -> dict[str, Any]:
        """Experimental: one torchrun per container, rendezvous at container 0 over the cluster network."""
        cluster = modal.Cluster.from_context()
        ips = cluster.container_ips(family="ipv4") or cluster.container_ips()
        return _train(config_yaml, run_name, gpus, len(ips), cluster.container_rank(), ips[0])


@app.function(gpu=EVAL_GPU, volumes={VOLUME_PATH: volume}, secrets=[hf_secret], timeout=4 * 60 * 60)
def evaluate(run_name: str, split: str = "val") -> int:
    """Evaluate the newest checkpoint of a run out of band (`nanopt eval`), while training may continue."""
    volume.reload()  # see the checkpoints the training container committed since this one started
    code = subprocess.run(eval_command(run_dir_for(run_name), split), cwd=VOLUME_PATH, env=launch_env()).returncode
    volume.commit()
    return code


@app.function(**BENCH_OPTIONS)
def bench(name: str = "gpu_check", args: str = "") -> int:
    """A bench on one H100: `modal run modal_app.py::bench --args "--quick"` (bench/gpu_check.py's quick check, the
    cheapest proof that the image builds and runs), or `--name vs_hf --args "--repeats 7"`.

    Where the 1.5x-over-Hugging-Face goal and the GPU rungs of the ladder get measured (docs/results.md). The
    bench's table is printed to this terminal; gpu_check's files go to the Volume, committed even if it fails.
    """
    out_dir = bench_out_dir(name, args, time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    cmd = bench_command(name, args, f"{VOLUME_PATH}/{out_dir}" if out_dir else "")
    print("modal_app: " + shlex.join(cmd), flush=True)
    try:  # from the Volume root, as training does: a relative --out of your own lands on the Volume too
        code, _ = run_forwarding_signals(cmd, VOLUME_PATH, launch_env(int(BENCH_CPUS)))
    finally:
        volume.commit()
        if out_dir:
            print(f"modal_app: results: Volume '{VOLUME_NAME}', {out_dir}/  "
                  f"(modal volume get {VOLUME_NAME} {out_dir})", flush=True)
    return code


@app.function(cpu=PREPARE_CPUS, memory=64 * 1024, volumes={VOLUME_PATH: volume}, secrets=[hf_secret],
              timeout=DAY_S)
def prepare_data(config_yaml: str, run_name: str) -> int:
    """`nanopt prepare` on a many-core CPU container, writing token shards to data.dir on the Volume."""
    from nanopt.config import load_config

    config_path = write_run_config(config_yaml, run_name)
    workers = load_config(config_path).prepare.workers or int(PREPARE_CPUS)  # the config's own choice wins
    with committing(COMMIT_EVERY_S):
        return subprocess.run(prepare_command(config_path, workers), cwd=VOLUME_PATH, env=launch_env()).returncode


def trainer_for(nodes: int, gpu_spec: str, gpus: int, wandb: bool) -> Any:
    """The training function for this many nodes, on these GPUs (`gpus` of them per node), with the secrets the
    config needs and host resources for as many ranks."""
    secrets = [hf_secret, wandb_secret] if wandb else [hf_secret]
    options = dict(gpu=gpu_spec, secrets=secrets, **train_resources(gpus))
    return (train_multinode if nodes > 1 else train).with_options(**options)


@app.function(timeout=DAY_S)  # no GPU, a fraction of a core: it only waits for prepare, then starts training
def prepare_then_train(config_yaml: str, run_name: str, gpus: int, gpu_spec: str, wandb: bool = False,
                       nodes: int = 1) -> dict[str, Any]:
    """`--prepare`: prepare on the CPU container, then start training on the GPUs, all on Modal's side, so a
    laptop that disconnects during a `--detach` run's prepare still gets its training. Returns the training
    call's id (the entrypoint waits for it) or, when prepare failed, the error; the GPUs are not billed
    during prepare."""
    code = prepare_data.remote(config_yaml, run_name)
    if code != 0:
        return {"run_dir": f"{VOLUME_PATH}/{run_dir_for(run_name)}", "exit_code": code,
                "error": f"nanopt prepare exited with code {code}; see the log above. Training was not started."}
    # spawn, not remote: training outlives this function's 24 h timeout when it takes several attempts.
    return {"call_id": trainer_for(nodes, gpu_spec, gpus, wandb).spawn(config_yaml, run_name, gpus).object_id}


def tensorboard_wsgi(logdir: str, reload_every_s: float = 30.0) -> Any:
    """TensorBoard (every installed plugin, the PyTorch Profiler's included) as a WSGI app; page loads reload the
    Volume, at most every `reload_every_s`, so new events from training show up."""
    from tensorboard import program
    from tensorboard.backend import application

    board = program.TensorBoard()  # default plugins = TensorBoard's own + entry points (torch_tb_profiler)
    board.configure(logdir=logdir, reload_interval=30, load_fast="false")  # in-process reader, no data server
    # No public "give me the WSGI app" call: this is what its own server (and Modal's example) does.
    data_provider, multiplexer = board._make_data_provider()
    tb_app = application.TensorBoardWSGIApp(board.flags, board.plugin_loaders, data_provider,
                                            board.assets_zip_provider, multiplexer)
    last_reload = [0.0]

    def with_volume_reload(environ: dict, start_response: Any) -> Any:
        if environ.get("PATH_INFO") == "/" and time.monotonic() - last_reload[0] > reload_every_s:
            last_reload[0] = time.monotonic()
            try:
                volume.reload()
            except Exception as e:  # e.g. files held open; the next page load tries again
                print(f"modal_app: volume reload skipped ({e})", flush=True)
        return tb_app(environ, start_response)

    return with_volume_reload


@app.function(volumes={VOLUME_PATH: volume}, scaledown_window=15 * 60, timeout=DAY_S)
@modal.concurrent(max_inputs=50)
@modal.wsgi_app()
def tensorboard_app() -> Any:
    """TensorBoard over every run directory on the Volume."""
    return tensorboard_wsgi(f"{VOLUME_PATH}/runs")


# ---------------------------------------------------------------- local entrypoint
def web_url(function: Any) -> str:
    try:
        return function.get_web_url() or "(not available)"
    except Exception as e:
        return f"(not available: {e})"


def wait_for_call(call_id: str) -> Any:
    """The result of a spawned call (its retries included), waiting as long as it takes."""
    return modal.FunctionCall.from_id(call_id).get()


@app.local_entrypoint()
def main(config: str, gpus: int = TRAIN_GPUS, gpu_type: str = TRAIN_GPU, run_name: str = "",
         prepare: bool = False) -> None:
    """Validate the config here, then (prepare and) train on Modal; exit with the training's status."""
    from nanopt.config import ConfigError

    try:
        config_yaml, cfg = check_config(config, gpus * NODES, run_name, NODES)
    except ConfigError as e:
        print(f"modal_app: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    name = cfg.run.name
    gpu_spec = f"{gpu_type}:{gpus}"

    run_dir = run_dir_for(name)
    print(f"run:         {name} on {NODES} x {gpu_spec}")
    print(f"results:     Volume '{VOLUME_NAME}', {run_dir}/  (modal volume get {VOLUME_NAME} {run_dir})")
    print(f"tensorboard: {web_url(tensorboard_app)}  (while this app runs; `modal deploy modal_app.py` keeps it)")
    print(f"evaluate:    modal run modal_app.py::evaluate --run-name {name}")
    try:
        if prepare:
            launched = prepare_then_train.remote(config_yaml, name, gpus, gpu_spec, cfg.log.wandb, NODES)
            result = wait_for_call(launched["call_id"]) if "call_id" in launched else launched
        else:
            result = trainer_for(NODES, gpu_spec, gpus, cfg.log.wandb).remote(config_yaml, name, gpus)
    except Exception as e:  # the last attempt Modal allowed failed, or Modal itself did
        print(f"modal_app: error: training failed: {type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(getattr(e, "exit_code", 1)) from None
    if result["exit_code"] != 0:  # `modal run` exits 0 unless the entrypoint says otherwise
        print(f"modal_app: error: {result['error']}", file=sys.stderr)
        raise SystemExit(result["exit_code"])
    print(f"done:        {result}")


# ---------------------------------------------------------------- sweeps: one container per grid point
# `sweep` is a remote driver, not a second local entrypoint: `modal run modal_app.py --config ...` stays unambiguous,
# `--detach` keeps a sweep going after the laptop disconnects, and it reads the Volume directly to skip finished points.
class SweepError(RuntimeError):
    """Raised by the sweep driver: `modal run` then prints the message and exits 1."""


def sweep_config_path(config: str) -> str:
    """The config inside the container: a relative path from the repository root, where the image has configs/."""
    path = Path(config) if Path(config).is_absolute() else REPO / config
    if not path.is_file():
        raise SweepError(f"--config {config}: no such file in the image. The sweep runs on Modal's side, which sees "
                         f"only the repository's configs/ directory (mounted at {REPO / 'configs'}); put the config "
                         f"there and give its path relative to the repository, e.g. configs/tiny.yaml.")
    return str(path)


def sweep_configs(config: str, sets: str, seeds: int, name: str, gpus: int) -> tuple[str, list[tuple[str, str, Any]]]:
    """(sweep name, [(run name on the Volume "NAME/POINT", config YAML, the point's resolved Config)]) for `nanopt
    sweep`'s grid of `config` x `sets` ("KEY=V1,V2;KEY2=..." ) x `seeds`, each point checked for `gpus` GPUs
    before any GPU is paid for. Raises nanopt's ConfigError."""
    from nanopt.config import ConfigError, load_config, parse_overrides, to_yaml
    from nanopt.lab.sweep import plan

    set_args = [s.strip() for s in sets.split(";") if s.strip()]
    if not set_args and seeds == 1:
        raise ConfigError("nothing to sweep: give --sets 'KEY=V1,V2[;KEY2=...]' and/or --seeds N with N > 1.")
    points, resolved = plan(config, set_args, seeds, [], gpus)
    sweep = name or f"{Path(config).stem}-sweep"
    if "/" in sweep or sweep in (".", ".."):
        raise ConfigError(f"--name {sweep!r}: a sweep name is one directory name.")
    out = []
    for point in points:
        cfg = load_config(config, parse_overrides(point.overrides()))
        cfg.run.name, cfg.run.dir = point.name, run_dir_for(f"{sweep}/{point.name}")
        out.append((f"{sweep}/{point.name}", to_yaml(cfg), resolved[point.name]))
    return sweep, out


@app.function(volumes={VOLUME_PATH: volume}, timeout=DAY_S)  # no GPU: it spawns the trainings and waits
def sweep(config: str, sets: str = "", seeds: int = 1, name: str = "", gpus: int = 1,
          gpu_type: str = TRAIN_GPU) -> dict[str, int]:
    """`modal run modal_app.py::sweep --config configs/C.yaml --sets 'optim.name=adamw,muon' --seeds 3`: every grid
    point trains in its own container at once, under runs/NAME/POINT/ on the Volume. Finished points are skipped,
    interrupted ones resume, failed ones are reported while the rest go on; a point whose directory ran another
    config is refused before any GPU starts. Returns {run name: exit code}; raises SweepError (exit 1) on a bad
    grid, a refused point or a failed run."""
    from nanopt.config import ConfigError
    from nanopt.lab.sweep import point_states

    try:
        sweep_name, runs = sweep_configs(sweep_config_path(config), sets, seeds, name, gpus)
        volume.reload()  # see runs that other containers finished since this one started
        # done / resume / new by nanopt sweep's own rules; refused where a point's directory ran another config
        root = Path(VOLUME_PATH)
        states = point_states([(run, root / run_dir_for(run), cfg) for run, _, cfg in runs],
                              root / run_dir_for(sweep_name))
    except ConfigError as e:
        raise SweepError(f"the sweep was refused before any GPU started: {e}") from None
    gpu_spec = f"{gpu_type}:{gpus}"
    print(f"sweep {sweep_name}: {len(runs)} runs on {gpu_spec} each; results on Volume '{VOLUME_NAME}', "
          f"{run_dir_for(sweep_name)}/ (then `nanopt runs {run_dir_for(sweep_name)}`)", flush=True)
    calls, codes = {}, {}
    for run_name, config_yaml, _ in runs:
        if states[run_name] == "done":
            print(f"  {run_name}: finished before, skipped", flush=True)
            codes[run_name] = 0
            continue
        calls[run_name] = train.with_options(gpu=gpu_spec, **train_resources(gpus)).spawn(config_yaml, run_name, gpus)
    for run_name, call in calls.items():  # in grid order, one line per run
        try:
            result = call.get()
            codes[run_name] = result["exit_code"]
            line = "done" if result["exit_code"] == 0 else f"failed: {result['error']}"
        except Exception as e:  # out of retries, or Modal itself failed
            codes[run_name] = getattr(e, "exit_code", 1)
            line = f"failed: {type(e).__name__}: {e}"
        print(f"  {run_name}: {line}", flush=True)
    failed = [n for n, c in codes.items() if c != 0]
    print(f"sweep {sweep_name}: {len(codes) - len(failed)} of {len(codes)} runs finished", flush=True)
    if failed:
        raise SweepError(f"{len(failed)} of {len(codes)} runs failed: {', '.join(failed)}; re-run the same command "
                         f"to retry them (finished runs are skipped).")
    return codes
