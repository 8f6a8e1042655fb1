"""The tiny Wan model, its denoising loops and the configurations users turn on around it (diffusers' offloading,
casting and cache hooks, accelerate, peft, torchao, bitsandbytes), shared by tests/test_compose.py and
benchmarks/cpu_figures.py (which measures README's figures from them and runs without pytest)."""
import torch
from diffusers import WanTransformer3DModel
from diffusers.hooks import (FirstBlockCacheConfig, HookRegistry, MagCacheConfig, PyramidAttentionBroadcastConfig,
                             SeaCacheConfig, TaylorSeerCacheConfig, apply_first_block_cache, apply_group_offloading,
                             apply_mag_cache, apply_pyramid_attention_broadcast, apply_sea_cache,
                             apply_taylorseer_cache)

INPUTS = (torch.Size([1, 4, 8, 32, 32]), 2048)   # 8 * 16 * 16 = 2048 rows
T = [1000]   # the current timestep, for the caches that ask for it


def wan_model() -> WanTransformer3DModel:
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4,
                                 out_channels=4, text_dim=32, freq_dim=32, ffn_dim=128, num_layers=3,
                                 rope_max_seq_len=64).eval()


def steps(model, seed=0):
    """Two denoising calls in one cache context, the second on a slightly moved input (the first-block cache then
    reuses the tail blocks' residual): each call's output."""
    g = torch.Generator().manual_seed(seed)
    x, t, enc = torch.randn(INPUTS[0], generator=g), torch.tensor([10]), torch.randn(1, 7, 32, generator=g)
    x2 = x + 1e-3 * torch.randn(INPUTS[0], generator=g)
    outs = []
    HookRegistry.check_if_exists_or_initialize(model).reset_stateful_hooks()   # as a pipeline does between runs
    with torch.no_grad(), model.cache_context("cond"):
        for xi in (x, x2):
            outs.append(model(xi, t, enc).sample)
    return outs


def denoise(model, n=4, batch=1, kwargs=False):
    """``n`` denoising steps, each in its cache context, the latent moved by the output: each step's output."""
    g = torch.Generator().manual_seed(0)
    x, enc = torch.randn(INPUTS[0], generator=g), torch.randn(batch, 7, 32, generator=g)
    outs = []
    HookRegistry.check_if_exists_or_initialize(model).reset_stateful_hooks()
    with torch.no_grad():
        for i in range(n):
            T[0] = 1000 - 250 * i
            t = torch.tensor([T[0]] * batch)
            with model.cache_context("cond", step_index=i, sigma=1 - i / n, num_inference_steps=n):
                xb = torch.cat([x] * batch)
                out = (model(hidden_states=xb, timestep=t, encoder_hidden_states=enc) if kwargs
                       else model(xb, t, enc)).sample
            outs.append(out)
            x = x - 0.1 * out[-1:]
    return outs


# --- weights and offloading --------------------------------------------------------------------------------------
def block_level(m):
    apply_group_offloading(m, onload_device="cpu", offload_device="cpu", offload_type="block_level",
                           num_blocks_per_group=1)


def leaf_level(m):
    apply_group_offloading(m, onload_device="cpu", offload_device="cpu", offload_type="leaf_level")


def sequential_offload(m):   # what enable_sequential_cpu_offload applies: weights on meta, loaded per call
    from accelerate import cpu_offload
    cpu_offload(m, execution_device=torch.device("cpu"))


def casting(m):   # fp8 storage: a graph that read the stored weights would be far off (or fail)
    m.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)


def first_block_cache(m):
    apply_first_block_cache(m, FirstBlockCacheConfig(threshold=0.05))


def lora(model):
    """r=4 adapters with random A and B on every linear of the blocks, block 1's at scale 0.5 (per-block adapter
    weights, as ``set_adapters(weights=...)`` gives): (the model, its LoRA layers)."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer
    model = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=[
        "to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2"]), model).eval()
    for layer in model.blocks[1].modules():
        if isinstance(layer, LoraLayer):
            layer.scaling["default"] = 0.5
    return model, [m for m in model.modules() if isinstance(m, LoraLayer)]


def int8_weight_only(m):
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    quantize_(m, Int8WeightOnlyConfig())


def bnb_blocks(model, bits):
    """The blocks' linears as bitsandbytes layers (quantised on their move to the device, here the CPU)."""
    import bitsandbytes as bnb
    for parent in list(model.blocks.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                kw = ({"has_fp16_weights": False} if bits == 8
                      else {"compute_dtype": torch.float32, "quant_type": "nf4"})
                layer = (bnb.nn.Linear8bitLt if bits == 8 else bnb.nn.Linear4bit)(
                    child.in_features, child.out_features, bias=child.bias is not None, **kw)
                layer.load_state_dict(child.state_dict())
                setattr(parent, name, layer.to("cpu").eval())
    return model


# --- the cache configs of the pinned diffusers (enable_cache's list) ---------------------------------------------
def mag_cache(m):
    apply_mag_cache(m, MagCacheConfig(mag_ratios=[1.0] * 4, num_inference_steps=4, retention_ratio=0.25,
                                      max_skip_steps=1))


def sea_cache(m):
    apply_sea_cache(m, SeaCacheConfig(threshold=10.0, cache_end_steps=0))


def taylorseer(**kw):
    """TaylorSeer every second step after the first, fp32 factors; ``kw``: which modules (or lite mode)."""
    return lambda m: apply_taylorseer_cache(m, TaylorSeerCacheConfig(
        cache_interval=2, disable_cache_before_step=1, taylor_factors_dtype=torch.float32, **kw))


def pyramid(m):
    apply_pyramid_attention_broadcast(m, PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 901),
        spatial_attention_block_identifiers=("blocks",), current_timestep_callback=lambda: T[0]))
