"""The Llama model: RMSNorm -> RoPE -> GQA attention -> SwiGLU MLP -> block -> Llama.

Opt-in speedrun options (ModelConfig: qk_norm, mlp=relu2, logit_softcap, value_embeddings, residual_scalars) are
off by default; with all off the modules, state_dict keys, a seed's weights and the forward pass are the plain Llama
that hf.py exports. `parametrization: mup` (µP, docs/scaling.md) scales the hidden init and the logits by the width."""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanopt.config import ModelConfig
from nanopt.distributed.runtime import recompute
from nanopt.errors import ConfigError
from nanopt.recipe.attention import AttentionFn, sdpa

# Loss chunk (positions) under torch.no_grad when train.loss_chunk_tokens is 0 (see Llama._chunked_loss).
NO_GRAD_CHUNK_TOKENS = 8192

# Marks a Linear writing into the residual stream: init_weights scales its std by 1/sqrt(2 * n_layers).
RESIDUAL_OUT = "residual_out"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In fp32, as Llama does. Under autocast cast once here: the Linears after it would each cast (and save) it.
        y = self.weight * rms_normalize(x.float(), self.eps).to(x.dtype)
        if torch.is_autocast_enabled(y.device.type):
            return y.to(torch.get_autocast_dtype(y.device.type))
        return y


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, no gain: ... D -> ... D."""
    return _RMSNormalize.apply(x, eps)


class _RMSNormalize(torch.autograd.Function):
    """A hand-written backward, 3 kernels instead of autograd's 7: y = x * r, dx = r * (g - y * mean(g * y))."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        r = torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() / x.shape[-1] + eps)  # ... 1
        y = x * r
        ctx.save_for_backward(y, r)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        y, r = ctx.saved_tensors
        mean_gy = torch.linalg.vecdot(g, y).unsqueeze(-1) / y.shape[-1]  # ... 1
        return torch.addcmul(g, y, mean_gy, value=-1) * r, None


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,), with Llama-3's long-context scaling when configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if cfg.rope_scaling == "llama3":
        old_len = cfg.rope_original_max_seq_len
        low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        interpolated = (1 - smooth) * inv_freq / cfg.rope_factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / cfg.rope_factor,
                               torch.where(wavelen < old_len / high, inv_freq, interpolated))
    return inv_freq.float()


def rope_tables(cfg: ModelConfig, seq_len: int,
                device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables (seq_len, head_dim), HF's rotate-half layout with its sign in sin: [-sin, sin]."""
    inv_freq = rope_frequencies(cfg).to(device)
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # T D/2
    return torch.cat([freqs, freqs], dim=-1).cos(), torch.cat([-freqs.sin(), freqs.sin()], dim=-1)  # T D each


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, a roll and the signed sin table. x: B H T D, cos/sin: T D."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin).to(x.dtype)


# One layer's key and value buffers for incremental decoding: B Hkv Tmax D each.
KVCache = tuple[torch.Tensor, torch.Tensor]


def residual_linear(in_features: int, out_features: int) -> nn.Linear:
    lin = nn.Linear(in_features, out_features, bias=False)
    setattr(lin, RESIDUAL_OUT, True)
    return lin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, kernel: AttentionFn = sdpa):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = residual_linear(cfg.n_heads * cfg.head_dim, cfg.dim)
        # qk_norm: None = off, else the eps of the per-head RMS norm of q and k.
        self.qk_norm_eps: Optional[float] = cfg.norm_eps if cfg.qk_norm else None
        # Registered only when on, so a default state_dict (hf.py exports it) has no such key.
        self.value_embed = nn.Embedding(cfg.vocab_size, cfg.n_kv_heads * cfg.head_dim) if cfg.value_embeddings else None
        self.kernel = kernel

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, idx: torch.Tensor,
                cache: Optional[KVCache] = None, start_pos: int = 0) -> torch.Tensor:
        """x: B T C; idx: the B T token ids of x's positions (read by value embeddings)."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # B Hq T D
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # B Hkv T D
        v = self.wv(x)  # B T Hkv*D
        if self.value_embed is not None:  # before the KV cache write: a cached position keeps its own token's
            # The lookup is fp32 under autocast while wv's output is bf16: match it so q, k, v share a dtype.
            v = v + self.value_embed(idx).to(v.dtype)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # B Hkv T D
        if self.qk_norm_eps is not None:  # before RoPE: the rotation keeps the norm, the scores stay bounded
            # Each head's vector, no gain, in fp32 like RMSNorm.
            q, k = (rms_normalize(t.float(), self.qk_norm_eps).to(t.dtype) for t in (q, k))  # B H T D each
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            for buffer, new in zip(cache, (k, v)):
                buffer[:B, :, start_pos : start_pos + T] = new
            k, v = (buffer[:B, :, : start_pos + T] for buffer in cache)  # B Hkv start_pos+T D each
        y = self.kernel(q, k, v, start_pos)  # B Hq T D
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), or with `mlp: relu2` w2(relu(w1 x)^2) and no w3."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.relu2 = cfg.mlp == "relu2"
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate (relu2: the only input matrix)
        if not self.relu2:
            self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.w2 = residual_linear(cfg.ffn_dim, cfg.dim)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # B T C -> B T F -> B T C
        if self.relu2:
            return self.w2(F.relu(self.w1(x)).square())
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ResidualScalars(nn.Module):
    """`residual_scalars`: a block's input becomes a * x + b * x0, x0 the embedding output, a and b learned (1 and 0
    at init: the plain residual stream; shape (1,): the scalar kind); b lets every layer re-read the embedding."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.ones(1))
        self.b = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        # The scalars are fp32 parameters: cast them so a bf16 residual stream stays bf16.
        return self.a.to(x.dtype) * x + self.b.to(x.dtype) * x0  # B T C


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, kernel: AttentionFn = sdpa):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, kernel)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.residual_scalars: Optional[ResidualScalars] = ResidualScalars() if cfg.residual_scalars else None

    def forward(self, x: torch.Tensor, x0: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, idx: torch.Tensor,
                cache: Optional[KVCache] = None, start_pos: int = 0) -> torch.Tensor:
        """x, x0 (the embedding output, for residual scalars): B T C; idx: B T token ids (value embeddings)."""
        if self.residual_scalars is not None:
            x = self.residual_scalars(x, x0)
        x = x + self.attention(self.attention_norm(x), cos, sin, idx, cache, start_pos)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig, kernel: AttentionFn = sdpa, loss_chunk_tokens: int = 8192):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, kernel) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_head()
        rope_shape = (cfg.max_seq_len or 2048, cfg.head_dim)  # T D; init_weights computes them where they live
        self.register_buffer("rope_cos", torch.empty(rope_shape), persistent=False)
        self.register_buffer("rope_sin", torch.empty(rope_shape), persistent=False)
        self.loss_chunk_tokens = loss_chunk_tokens
        # train.compile_blocks's compiled blocks for a training forward: a plain list, so state_dict keys stay.
        self.training_blocks: Optional[list[nn.Module]] = None
        # train.recompute: a training forward keeps each block's input only and runs it again in backward.
        self.recompute_blocks = False

    def tie_head(self) -> None:
        """Make the LM head the embedding matrix again, when tied (to_empty and device moves untie them)."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def set_attention(self, kernel: AttentionFn) -> None:
        """Switch the attention kernel of every layer (benches and tests compare kernels on one model)."""
        for layer in self.layers:
            layer.attention.kernel = kernel

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter by its module's type (_init_by_type) and recompute the RoPE tables. A
        parameter no rule covers raises, naming its module: it would be uninitialised memory."""
        done: set[int] = set()  # ids of initialised parameters; a tied head shares the embedding's
        for module in self.modules():
            if any(id(p) not in done for p in module.parameters(recurse=False)):
                done.update(id(p) for p in _init_by_type(module, self.cfg, readout=module is self.lm_head))
        missing = [f"{name}.{pname} ({type(m).__name__})" for name, m in self.named_modules()
                   for pname, p in m.named_parameters(recurse=False) if id(p) not in done]
        if missing:
            raise TypeError(f"init_weights has no rule for {', '.join(missing)}: add one to _init_by_type")
        cos, sin = rope_tables(self.cfg, self.rope_cos.shape[0], device=self.rope_cos.device)  # T D each
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Unique parameters; exclude_embedding leaves out every lookup table."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            n -= sum(p.numel() for m in self.modules() if isinstance(m, nn.Embedding) for p in m.parameters())
        return n

    def hidden(self, idx: torch.Tensor, caches: Optional[list[KVCache]] = None, start_pos: int = 0) -> torch.Tensor:
        """Final normalised hidden states, B T C."""
        T = idx.shape[1]
        cos, sin = self.rope_cos[start_pos : start_pos + T], self.rope_sin[start_pos : start_pos + T]  # T D each
        x = x0 = self.embed(idx)  # B T C; x0 stays the embedding (residual scalars re-read it every layer)
        # Only a training forward runs compiled blocks: evaluation and decoding never compile shapes of their own.
        training = caches is None and torch.is_grad_enabled()
        blocks = self.training_blocks if training and self.training_blocks is not None else self.layers
        for i, layer in enumerate(blocks):
            if training and self.recompute_blocks:
                # x0 is an argument, not captured: XLA's reentrant checkpoint returns gradients to its inputs only;
                # `layer` is bound now, since backward calls the function again after the loop has moved on.
                x = recompute(lambda x, x0, cos, sin, layer=layer: layer(x, x0, cos, sin, idx), x, x0, cos, sin)
            else:
                x = layer(x, x0, cos, sin, idx, caches[i] if caches is not None else None, start_pos)
        return self.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of hidden states: B T C @ C V -> B T V, soft-capped (in fp32) when logit_softcap is set."""
        return soft_cap(self.lm_head(self.readout_input(h)), self.cfg.logit_softcap)

    def readout_input(self, h: torch.Tensor) -> torch.Tensor:
        """h (B T C) × µP's output multiplier 1/width_mult (sp: h itself)."""
        return h if self.cfg.width_mult == 1.0 else h / self.cfg.width_mult

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None,
                caches: Optional[list[KVCache]] = None, start_pos: int = 0) -> torch.Tensor:
        """idx: B T token ids. Returns logits B T V, or the mean cross-entropy against targets (-100: ignored)."""
        h = self.hidden(idx, caches, start_pos)
        return self.logits(h) if targets is None else self._chunked_loss(h, targets)  # B T V, or a scalar

    def _chunked_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy holding one chunk's logits at a time, each recomputed in backward."""
        B, T, _ = h.shape
        h = self.readout_input(h)
        count = (targets != -100).sum().clamp(min=1)
        # Bound here: recompute (torch_xla's reentrant checkpoint on XLA) takes tensor arguments only.
        loss_sum = functools.partial(_chunk_loss_sum, softcap=self.cfg.logit_softcap)
        # Without autograd chunks cost nothing: evaluation stays bounded where training runs unchunked.
        chunk = self.loss_chunk_tokens if torch.is_grad_enabled() else self.loss_chunk_tokens or NO_GRAD_CHUNK_TOKENS
        if chunk <= 0 or B * T <= chunk:
            return loss_sum(h, targets, self.lm_head.weight) / count
        # Chunks along the sequence span the batch: under XLA SPMD every chunk keeps every device busy.
        step = max(1, chunk // B)
        return sum(recompute(loss_sum, h[:, s : s + step], targets[:, s : s + step], self.lm_head.weight)
                   for s in range(0, T, step)) / count

    def new_caches(self, batch: int, max_len: int, device: torch.device, dtype: torch.dtype) -> list[KVCache]:
        shape = (batch, self.cfg.n_kv_heads, max_len, self.cfg.head_dim)
        new = functools.partial(torch.zeros, shape, device=device, dtype=dtype)
        return [(new(), new()) for _ in self.layers]


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap) in fp32, or the logits when cap is 0 (off)."""
    return logits if cap <= 0 else cap * torch.tanh(logits.float() / cap)  # B T V, fp32 when capped


def _chunk_loss_sum(h: torch.Tensor, t: torch.Tensor, weight: torch.Tensor, softcap: float = 0.0) -> torch.Tensor:
    """Summed cross-entropy of h (B T C) against t (B T), -100 ignored; logits soft-capped when softcap > 0."""
    logits = soft_cap(F.linear(h, weight), softcap)  # B T C @ C V -> B T V
    return F.cross_entropy(logits.float().flatten(0, 1), t.flatten(), ignore_index=-100, reduction="sum")


def _init_by_type(module: nn.Module, cfg: ModelConfig, readout: bool = False) -> list[nn.Parameter]:
    """Initialise one module's own parameters by its type; returns those it set. Under µP a hidden Linear's std
    falls as 1/sqrt(width_mult); embeddings and the `readout` keep init_std."""
    if isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, 0.0, cfg.init_std)
        return [module.weight]
    if isinstance(module, nn.Linear):  # weight only: a bias would need a rule (init_weights reports it)
        depth_scale = 1 / math.sqrt(2 * cfg.n_layers) if getattr(module, RESIDUAL_OUT, False) else 1.0
        fan_in_scale = 1.0 if readout else 1 / math.sqrt(cfg.width_mult)  # sp: exactly 1.0
        nn.init.normal_(module.weight, 0.0, cfg.init_std * depth_scale * fan_in_scale)
        return [module.weight]
    if isinstance(module, RMSNorm):
        module.weight.fill_(1.0)
        return [module.weight]
    if isinstance(module, ResidualScalars):  # start as the plain residual stream: 1 * x + 0 * x0
        module.a.fill_(1.0)
        module.b.fill_(0.0)
        return [module.a, module.b]
    return []


def meta_model(cfg: ModelConfig, kernel: AttentionFn = sdpa, loss_chunk_tokens: int = 8192) -> Llama:
    """The model's structure on the meta device, no parameter initialised (build_model's first step; FLOPs and
    memory are read from it)."""
    with torch.device("meta"), _SkipInit():
        return Llama(cfg, kernel, loss_chunk_tokens)


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu", *, kernel: AttentionFn | None = None,
                loss_chunk_tokens: int = 8192, dtype: torch.dtype = torch.float32,
                init_device: torch.device | str | None = None) -> Llama:
    """A ready model: built on the meta device, materialised on `init_device` (XLA: the host), initialised once,
    moved to `device`; a `dtype` (bf16-pure) casts the parameters, not the RoPE tables."""
    try:
        model = meta_model(cfg, kernel or sdpa, loss_chunk_tokens)
        model.to_empty(device=init_device or device)
    except (RuntimeError, TypeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if not any(why in str(e) for why in _TOO_BIG):
            raise
        raise ConfigError(f"the model section's parameters cannot be allocated on {init_device or device} "
                          f"({' '.join(str(e).split()[:12])} ...). Check model.dim, model.n_layers, model.ffn_dim and "
                          f"model.vocab_size (`nanopt estimate` sizes a config's memory).") from None
    model.tie_head()
    model.init_weights()
    model.to(device=device, dtype=dtype)  # a no-op unless moving (XLA) or casting (bf16-pure)
    model.tie_head()  # a move across device types re-creates the parameters, which unties them
    if dtype != torch.float32:
        # bf16 would round every cos/sin entry by up to 2^-9; apply_rope rotates in fp32 and casts back.
        model.rope_cos, model.rope_sin = rope_tables(cfg, model.rope_cos.shape[0], device=model.rope_cos.device)
    return model


class _SkipInit(torch.overrides.TorchFunctionMode):
    """nn.init's calls in the modules' constructors skipped: init_weights initialises once, after to_empty. On the
    meta device they would do nothing useful, and the first of them imports torch._dynamo (~1.5 s a process: torch's
    meta kernels of random ops are dynamo-disabled functions)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


# What torch says when a tensor of the config's sizes cannot exist: no memory for it, or a size past int64.
_TOO_BIG = ("can't allocate memory", "out of memory", "Overflow when unpacking long")

