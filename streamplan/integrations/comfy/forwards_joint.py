"""The streamed forwards of ComfyUI's joint-stream DiTs (0.33.0): Flux (``comfy.ldm.flux.model.Flux``) and
HunyuanVideo (``comfy.ldm.hunyuan_video.model.HunyuanVideo``), which share Flux's double and single stream blocks.

Their stock forwards keep text and image rows apart through the double blocks, then join them
(``torch.cat((txt, img), 1)``: a second whole-sequence residual while the first is alive) for the single blocks, and
run the final layer over every image row at once. Streamed, the image rows live in one buffer sized for the joint rows
from the start:

- the input projection (Flux's ``img_in`` Linear, HunyuanVideo's ``img_in`` Conv3d) writes row chunks into the
  buffer's image rows, ``[batch, rows, hidden]`` contiguous at its start;
- double blocks get those rows (donated to streamplan's own block replacement, which updates them in place; a stock or
  foreign block's output is copied back where it is not them) and the text rows as the stock forward has them;
- the join is made in place (``join``): each sample's image rows move up behind room for its text rows; single blocks
  get the joint rows, donated;
- the final layer runs on row chunks of the image rows into its small output, which the stock layout code then
  rearranges;
- the input projection's and the final layer's comfy.ops layers cast their weights once per loop, not per chunk
  (``forward_loops.row_loop``).

What is not covered keeps the stock forward, with the reason (``problem``): reference latents, post-input patches,
HunyuanVideo's guiding frame (modulation per row range) and reference latent. HunyuanVideo 1.5's text-side inputs
(condition-type embedding, ByT5 and vision rows, meanflow's second timestep) are followed."""
from __future__ import annotations

import functools

from typing import Any

import torch

from ...execute.chunk_loop import chunk_bounds
from ...execute.donation import donate
from .embed import grid_chunks, project_into, row_chunks
from .forward_loops import chunk_rows, row_loop


def _into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Rows a block returned, into the buffer's rows ``dst`` (nothing to do where the block updated ``dst`` itself)."""
    if src is dst or (src.data_ptr() == dst.data_ptr() and src.stride() == dst.stride()):
        return
    dst.copy_(src)


def join(buf: torch.Tensor, txt: torch.Tensor, chunk: int) -> torch.Tensor:
    """The stock forward's ``torch.cat((txt, img), 1)`` made in place: ``buf`` holds the image rows
    ``[batch, rows, width]`` contiguous from its start and has room for the text rows; each sample's image rows move
    up to follow its text rows (the last sample first, its last rows first, each chunk through a chunk-sized copy, so
    no row is overwritten before it has moved), then its text rows go in front. Returns ``buf`` as
    ``[batch, text + rows, width]``. (The double blocks get the image rows contiguous: a view of the joint layout
    would carry a batch stride of text + rows, which the capture cannot express over a symbolic row count.)"""
    bs, text, width = txt.shape
    rows = buf.numel() // (bs * width) - text
    img = buf[:bs * rows * width].view(bs, rows, width)
    hidden = buf.view(bs, text + rows, width)
    for b in reversed(range(bs)):
        for a, e in reversed(list(chunk_bounds(rows, chunk))):
            hidden[b, text + a:text + e] = img[b, a:e].clone()
        hidden[b, :text] = txt[b]
    return hidden


def _block(blocks_replace: dict, key: tuple, block_wrap, rows: torch.Tensor, mask: Any, own_mask: Any,
           make_args) -> tuple[dict, bool]:
    """One block call: through its "dit" replacement where one is set (streamplan's own gets ``rows``, a view of the
    buffer, donated and the mask as its blocks take it), else the host's stock call, its ``block_wrap``. Returns the
    block's output and whether ``rows`` was donated."""
    replacement = blocks_replace.get(key)
    if replacement is None:
        return block_wrap(make_args(mask)), False
    if getattr(replacement, "streamplan_donates", False):
        with donate(rows):
            return replacement(make_args(own_mask), {"original_block": block_wrap}), True
    return replacement(make_args(mask), {"original_block": block_wrap}), False


def _planned_chunk(state: Any, device: torch.device, model: Any, chunk: int) -> int:
    """A loop's chunk after blocks ran: in a forward planned ahead, the chunk its blocks planned (``chunk_rows``, as
    ``forward_budget.loop_chunk`` gives it once they planned); else ``chunk``, the input projection's."""
    if state.forward.loop_chunk is None:
        return chunk
    return chunk_rows(state, device, model.hidden_size * 6)


class Joint:
    """The block loops and the head over one joint buffer; ``Flux`` and ``HunyuanVideo`` differ in how they prepare
    rows and conditioning, in the arguments their blocks get and in their layout of the output."""

    plans_ahead = True   # rehearsed whole under a size budget (``forward_budget``)

    @classmethod
    def embed(cls, model: Any, call: dict, state: Any, patches: torch.Tensor, img_ids: Any, txt_ids: Any):
        """``img_in`` over ``patches`` [batch, rows, features] in row chunks into the image rows of one joint buffer
        (text rows after them, for the blocks to fill); its first chunk gives the dtype the conditioning is built in
        (``cls.conditioning``, whose text rows size the buffer). Returns (buffer, chunk, conditioning)."""
        bs, rows = patches.shape[0], patches.shape[1]
        chunk = chunk_rows(state, patches.device, model.hidden_size * 6)
        with row_loop(state, model.img_in):
            chunks = row_chunks(patches, chunk)
            (a, b), first = next(chunks)
            first = model.img_in(first)
            cond = cls.conditioning(model, call, first.dtype, img_ids, txt_ids)
            text = cond[1].shape[1]
            buf = torch.empty(bs * (text + rows) * model.hidden_size, dtype=first.dtype, device=first.device)
            img = buf[:bs * rows * model.hidden_size].view(bs, rows, model.hidden_size)
            img[:, a:b] = first
            del first
            project_into(img, chunks, model.img_in)
        return buf, chunk, cond

    @staticmethod
    def double_args(img, txt, vec, pe, mask, options) -> dict:
        raise NotImplementedError

    @staticmethod
    def single_args(img, vec, pe, mask, options) -> dict:
        raise NotImplementedError

    @staticmethod
    def double_wrap(block):
        raise NotImplementedError

    @staticmethod
    def single_wrap(block):
        raise NotImplementedError

    @classmethod
    def blocks(cls, model: Any, buf: torch.Tensor, txt: torch.Tensor, vecs: Any, pe: Any, mask: Any, options: dict,
               control: Any, state: Any, chunk: int) -> torch.Tensor:
        """Every double block over the image rows at the start of ``buf`` and the text rows ``txt``, the rows
        joined in place (``join``), every single block over them: the joint rows ``[batch, text + rows, width]``
        (a view of ``buf``). ``vecs``: the double and single blocks' modulation input, or ``vecs(kind, i)`` giving
        block ``i``'s ("double" or "single"; None: the stock forward skips that block). ControlNet additions as the
        stock forward makes them."""
        vec_of = vecs if callable(vecs) else (lambda kind, i: vecs[0] if kind == "double" else vecs[1])
        blocks_replace = options.get("patches_replace", {}).get("dit", {})
        bs, text, width = txt.shape
        rows = buf.numel() // (bs * width) - text
        img = buf[:bs * rows * width].view(bs, rows, width)
        own_mask = cls.streamed_mask(mask)
        donated = 0
        options["total_blocks"] = len(model.double_blocks)
        options["block_type"] = "double"
        for i, block in enumerate(model.double_blocks):
            options["block_index"] = i
            vec = vec_of("double", i)
            if vec is None:
                continue
            out, gave = _block(blocks_replace, ("double_block", i), cls.double_wrap(block), img, mask, own_mask,
                               functools.partial(cls.double_args, img, txt, vec, pe, options=options))
            donated += gave
            img_out, txt_out = out["img"], out["txt"]
            del out
            _into(img, img_out)
            txt = txt_out   # text-sized: the block's own (stock blocks update it in place, fp16 cleans a copy)
            del img_out, txt_out
            if control is not None:
                add = cls.control_at(control.get("input"), i)
                if add is not None:
                    cls.add_control_input(img, add)
        if img.dtype == torch.float16 and cls.fp16_clean:   # the stock forward's clean-up of the image rows
            torch.nan_to_num(img, nan=0.0, posinf=65504, neginf=-65504, out=img)
        del img
        chunk = _planned_chunk(state, buf.device, model, chunk)
        hidden = join(buf, txt, chunk)
        del txt

        options["total_blocks"] = len(model.single_blocks)
        options["block_type"] = "single"
        options["img_slice"] = [text, hidden.shape[1]]
        for i, block in enumerate(model.single_blocks):
            options["block_index"] = i
            vec = vec_of("single", i)
            if vec is None:
                continue
            out, gave = _block(blocks_replace, ("single_block", i), cls.single_wrap(block), hidden, mask, own_mask,
                               functools.partial(cls.single_args, hidden, vec, pe, options=options))
            donated += gave
            out = out["img"]
            _into(hidden, out)
            del out
            if control is not None:
                add = cls.control_at(control.get("output"), i)
                if add is not None:
                    cls.add_control_output(hidden, text, add)
        state.forward.donated_blocks = donated
        return hidden

    @staticmethod
    def streamed_mask(mask: Any) -> Any:
        """The attention mask as streamplan's own block replacements get it (the same values)."""
        return mask

    @staticmethod
    def control_at(adds: Any, i: int):
        return adds[i] if adds is not None and i < len(adds) else None

    @staticmethod
    def head(model: Any, img: torch.Tensor, vec: torch.Tensor, chunk: int, state: Any) -> torch.Tensor:
        """The final layer on row chunks of the image rows, into its ``[batch, rows, out]`` output."""
        chunk = _planned_chunk(state, img.device, model, chunk)
        out = None
        with row_loop(state, model.final_layer):
            for a, b in chunk_bounds(img.shape[1], chunk):
                y = model.final_layer(img[:, a:b], vec)
                if out is None:
                    out = y.new_empty(img.shape[0], img.shape[1], y.shape[-1])
                out[:, a:b] = y
                del y
        return out


# --- Flux (comfy.ldm.flux.model.Flux._forward and forward_orig, ComfyUI 0.33.0) -----------------------------------

class Flux(Joint):
    fp16_clean = True

    @staticmethod
    def double_args(img, txt, vec, pe, mask, options) -> dict:
        return {"img": img, "txt": txt, "vec": vec, "pe": pe, "attn_mask": mask, "transformer_options": options}

    @staticmethod
    def single_args(img, vec, pe, mask, options) -> dict:
        return {"img": img, "vec": vec, "pe": pe, "attn_mask": mask, "transformer_options": options}

    @staticmethod
    def double_wrap(block):
        """The "original_block" the host hands a double block replacement (a closure over the block module alone)."""
        def block_wrap(args):
            out = {}
            out["img"], out["txt"] = block(img=args["img"], txt=args["txt"], vec=args["vec"], pe=args["pe"],
                                           attn_mask=args.get("attn_mask"),
                                           transformer_options=args.get("transformer_options"))
            return out
        return block_wrap

    @staticmethod
    def single_wrap(block):
        def block_wrap(args):
            return {"img": block(args["img"], vec=args["vec"], pe=args["pe"], attn_mask=args.get("attn_mask"),
                                 transformer_options=args.get("transformer_options"))}
        return block_wrap

    @staticmethod
    def add_control_input(img: torch.Tensor, add: torch.Tensor) -> None:
        img[:, :add.shape[1]] += add

    @staticmethod
    def add_control_output(hidden: torch.Tensor, text: int, add: torch.Tensor) -> None:
        hidden[:, text:text + add.shape[1], ...] += add

    @staticmethod
    def problem(model: Any, call: dict) -> str | None:
        x = call.get("x")
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            return "x is not [batch, channels, height, width]"
        if call.get("ref_latents") is not None:
            return "ref_latents are given (reference image rows join the sequence)"
        if (call.get("transformer_options") or {}).get("patches", {}).get("post_input"):
            return "post_input patches are set (they may change the rows before the blocks)"
        return None

    @staticmethod
    def conditioning(model: Any, call: dict, dtype: torch.dtype, img_ids: torch.Tensor, txt_ids: torch.Tensor):
        """The modulation vector, text rows and rope as forward_orig builds them, in the image rows' ``dtype``."""
        from comfy.ldm.flux.model import timestep_embedding
        params, timestep, context, y, guidance = (model.params, call["timestep"], call["context"], call.get("y"),
                                                  call.get("guidance"))
        vec = model.time_in(timestep_embedding(timestep, 256).to(dtype))
        if params.guidance_embed and guidance is not None:
            vec = vec + model.guidance_in(timestep_embedding(guidance, 256).to(dtype))
        if model.vector_in is not None:
            if y is None:
                y = torch.zeros((img_ids.shape[0], params.vec_in_dim), device=txt_ids.device, dtype=dtype)
            vec = vec + model.vector_in(y[:, :params.vec_in_dim])
        txt = context if model.txt_norm is None else model.txt_norm(context)
        txt = model.txt_in(txt)
        pe = model.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))
        return vec, txt, pe

    @classmethod
    def forward(cls, model: Any, call: dict, state: Any) -> torch.Tensor:
        from einops import rearrange

        x, context, control = call["x"], call["context"], call.get("control")
        options = call.get("transformer_options", {})
        mask = (call.get("kwargs") or {}).get("attention_mask")
        params, p = model.params, model.patch_size
        bs, _, h_orig, w_orig = x.shape
        h_len, w_len = (h_orig + p // 2) // p, (w_orig + p // 2) // p
        patches, img_ids = model.process_img(x, transformer_options=options)   # [batch, rows, channels x p x p]
        txt_ids = torch.zeros((bs, context.shape[1], len(params.axes_dim)), device=x.device, dtype=torch.float32)
        for i in params.txt_ids_dims:
            txt_ids[:, :, i] = torch.linspace(0, context.shape[1] - 1, steps=context.shape[1], device=x.device,
                                              dtype=torch.float32)
        options = options.copy()   # as forward_orig

        buf, chunk, (vec, txt, pe) = cls.embed(model, call, state, patches, img_ids, txt_ids)
        text = txt.shape[1]
        del patches

        vec_orig = vec
        if params.global_modulation:
            vecs = ((model.double_stream_modulation_img(vec_orig), model.double_stream_modulation_txt(vec_orig)),
                    model.single_stream_modulation(vec_orig)[0])
        else:
            vecs = (vec, vec)
        hidden = cls.blocks(model, buf, txt, vecs, pe, mask, options, control, state, chunk)
        del buf, txt, pe, vecs
        out = cls.head(model, hidden[:, text:], vec_orig, chunk, state)
        del hidden
        return rearrange(out, "b (h w) (c ph pw) -> b c (h ph) (w pw)", h=h_len, w=w_len, ph=p,
                         pw=p)[:, :, :h_orig, :w_orig]


# --- HunyuanVideo (comfy.ldm.hunyuan_video.model.HunyuanVideo._forward and forward_orig, ComfyUI 0.33.0) ---------

class HunyuanVideo(Joint):
    fp16_clean = False

    @staticmethod
    def double_args(img, txt, vec, pe, mask, options) -> dict:
        return {"img": img, "txt": txt, "vec": vec, "pe": pe, "attention_mask": mask, "modulation_dims_img": None,
                "modulation_dims_txt": None, "transformer_options": options}

    @staticmethod
    def single_args(img, vec, pe, mask, options) -> dict:
        return {"img": img, "vec": vec, "pe": pe, "attention_mask": mask, "modulation_dims": None,
                "transformer_options": options}

    @staticmethod
    def double_wrap(block):
        def block_wrap(args):
            out = {}
            out["img"], out["txt"] = block(img=args["img"], txt=args["txt"], vec=args["vec"], pe=args["pe"],
                                           attn_mask=args["attention_mask"],
                                           modulation_dims_img=args["modulation_dims_img"],
                                           modulation_dims_txt=args["modulation_dims_txt"],
                                           transformer_options=args["transformer_options"])
            return out
        return block_wrap

    @staticmethod
    def single_wrap(block):
        def block_wrap(args):
            return {"img": block(args["img"], vec=args["vec"], pe=args["pe"], attn_mask=args["attention_mask"],
                                 modulation_dims=args["modulation_dims"],
                                 transformer_options=args["transformer_options"])}
        return block_wrap

    @staticmethod
    def streamed_mask(mask: Any) -> Any:
        """The text mask over the joint rows' keys, ``[1, 1, keys]``, as a ``[1, 1, 1, keys]`` view: the layout
        ComfyUI's attention functions make of it before attending (``attention_pytorch`` unsqueezes a 3-D mask), so
        the block's captured graph gets it straight at its attention, where a mask over the keys alone streams (whole
        for every Q chunk); given as ``[1, 1, keys]``, the unsqueeze inside the block keeps the block stock."""
        return mask.unsqueeze(1) if isinstance(mask, torch.Tensor) and mask.dim() == 3 else mask

    @staticmethod
    def add_control_input(img: torch.Tensor, add: torch.Tensor) -> None:
        img += add

    @staticmethod
    def add_control_output(hidden: torch.Tensor, text: int, add: torch.Tensor) -> None:
        hidden[:, text:] += add

    @staticmethod
    def problem(model: Any, call: dict) -> str | None:
        x = call.get("x")
        if not isinstance(x, torch.Tensor) or x.dim() != 5 or len(model.patch_size) != 3:
            return "x is not [batch, channels, frames, height, width] with 3-D patches"
        if not isinstance(model.img_in.norm, torch.nn.Identity) or not model.img_in.flatten:
            return "img_in is not a plain patch embedding (a norm after it, or no flattening)"
        for arg, what in (("ref_latent", "a reference latent (its rows join the sequence)"),
                          ("guiding_frame_index", "a guiding frame (modulation per row range)")):
            if call.get(arg) is not None:
                return f"{what} is given"
        return None

    @staticmethod
    def text(model: Any, call: dict, timestep: torch.Tensor, txt_mask: Any, txt_ids: torch.Tensor, options: dict):
        """The text rows and their ids as forward_orig builds them: the token refiner's rows, then (HunyuanVideo 1.5)
        the condition-type embedding, ByT5 rows and vision rows joined to them (text-sized)."""
        txt = model.txt_in(call["context"], timestep, txt_mask, transformer_options=options)
        cond_type = model.cond_type_embedding
        if cond_type is not None:
            cond_type.to(txt.device)
            txt = txt + cond_type(torch.zeros_like(txt[:, :, 0], device=txt.device, dtype=torch.long)).to(txt.dtype)
        byt5 = call.get("txt_byt5")
        if model.byt5_in is not None and byt5 is not None:
            byt5 = model.byt5_in(byt5)
            if cond_type is not None:
                byt5 = byt5 + cond_type(torch.ones_like(byt5[:, :, 0], device=byt5.device,
                                                        dtype=torch.long)).to(byt5.dtype)
                txt = torch.cat((byt5, txt), dim=1)
            else:
                txt = torch.cat((txt, byt5), dim=1)
            txt_ids = torch.cat((txt_ids, torch.zeros((txt_ids.shape[0], byt5.shape[1], txt_ids.shape[-1]),
                                                      device=txt_ids.device, dtype=txt_ids.dtype)), dim=1)
        clip_fea = call.get("clip_fea")
        if clip_fea is not None:
            vision = model.vision_in(clip_fea)
            if cond_type is not None:
                vision = vision + cond_type(2 * torch.ones_like(vision[:, :, 0], dtype=torch.long,
                                                                device=vision.device))
            txt = torch.cat((vision.to(txt.dtype), txt), dim=1)
            txt_ids = torch.cat((txt_ids, torch.zeros((txt_ids.shape[0], vision.shape[1], txt_ids.shape[-1]),
                                                      device=txt_ids.device, dtype=txt_ids.dtype)), dim=1)
        return txt, txt_ids

    @classmethod
    def conditioning(cls, model: Any, call: dict, dtype: torch.dtype, rows: int, img_ids: torch.Tensor,
                     txt_ids: torch.Tensor, options: dict):
        """The modulation vector, text rows, rope and the joint rows' text mask as forward_orig builds them, in the
        image rows' ``dtype``."""
        from comfy.ldm.hunyuan_video.model import timestep_embedding
        timestep, y, guidance, txt_mask = call["timestep"], call.get("y"), call.get("guidance"), call.get(
            "attention_mask")
        device = txt_ids.device
        vec = model.time_in(timestep_embedding(timestep, 256, time_factor=1.0).to(dtype))
        if model.time_r_in is not None and not call.get("disable_time_r"):   # meanflow: the next sigma's embedding
            w = torch.where(options["sigmas"][0] == options["sample_sigmas"])[0]
            if len(w) > 0:
                t_r = options["sample_sigmas"][w[0] + 1].unsqueeze(0).to(device=timestep.device, dtype=timestep.dtype)
                vec_r = model.time_r_in(timestep_embedding(t_r, 256, time_factor=1000.0).to(dtype))
                vec = (vec + vec_r) if model.params.meanflow_sum else (vec + vec_r) / 2
        if model.vector_in is not None:
            vec = vec + model.vector_in(y[:, :model.params.vec_in_dim])
        if model.params.guidance_embed and guidance is not None:
            vec = vec + model.guidance_in(timestep_embedding(guidance, 256).to(dtype))
        if txt_mask is not None and not torch.is_floating_point(txt_mask):
            txt_mask = (txt_mask - 1).to(dtype) * torch.finfo(dtype).max
        txt, txt_ids = cls.text(model, call, timestep, txt_mask, txt_ids, options)
        text = txt.shape[1]
        pe = model.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))
        del img_ids, txt_ids
        mask = None
        if txt_mask is not None:
            mask = torch.zeros((1, 1, rows + text), dtype=dtype, device=device)
            mask[:, 0, :text] = txt_mask
        return vec, txt, pe, mask

    @classmethod
    def forward(cls, model: Any, call: dict, state: Any) -> torch.Tensor:
        import comfy.ldm.common_dit as common_dit

        x, context, control = call["x"], call["context"], call.get("control")
        options = call.get("transformer_options", {})
        bs = x.shape[0]
        img_ids = model.img_ids(x)
        txt_ids = torch.zeros((bs, context.shape[1], 3), device=x.device, dtype=x.dtype)
        options = options.copy()   # as forward_orig
        initial_shape = list(x.shape)
        embed = model.img_in
        padded = common_dit.pad_to_patch_size(x, embed.patch_size, padding_mode=embed.padding_mode) \
            if embed.dynamic_img_pad else x
        pt, ph, pw = embed.patch_size
        grid = (padded.shape[2] // pt, padded.shape[3] // ph, padded.shape[4] // pw)
        rows = grid[0] * grid[1] * grid[2]

        chunk = chunk_rows(state, x.device, model.hidden_size * 6)
        def project(latent: torch.Tensor) -> torch.Tensor:
            return embed.proj(latent).flatten(2).transpose(1, 2)

        with row_loop(state, embed.proj):   # its first chunk gives the dtype, the rest go into the buffer
            chunks = grid_chunks(padded, embed.patch_size, chunk)
            (a, b), first = next(chunks)
            first = project(first)
            vec, txt, pe, mask = cls.conditioning(model, call, first.dtype, rows, img_ids, txt_ids, options)
            del img_ids, txt_ids
            text = txt.shape[1]
            buf = torch.empty(bs * (text + rows) * model.hidden_size, dtype=first.dtype, device=x.device)
            img = buf[:bs * rows * model.hidden_size].view(bs, rows, model.hidden_size)
            img[:, a:b] = first
            del first
            project_into(img, chunks, project)
        del chunks, padded, img

        hidden = cls.blocks(model, buf, txt, (vec, vec), pe, mask, options, control, state, chunk)
        del buf, txt, pe, mask
        img = cls.head(model, hidden[:, text:], vec, chunk, state)
        del hidden
        # the stock forward's layout of the final layer's rows
        shape = initial_shape[-len(model.patch_size):]
        for i in range(len(shape)):
            shape[i] = shape[i] // model.patch_size[i]
        img = img.reshape([img.shape[0]] + shape + [model.out_channels] + model.patch_size)
        img = img.permute(0, 4, 1, 5, 2, 6, 3, 7)
        return img.reshape(initial_shape[0], model.out_channels, initial_shape[2], initial_shape[3],
                           initial_shape[4])


# --- Chroma (comfy.ldm.chroma.model.Chroma._forward and forward_orig, ComfyUI 0.33.0) ------------------------------

class Chroma(Flux):
    """Flux's blocks and block arguments; its modulation per block from the distilled guidance layer's vectors
    (``get_modulations``, the model's own), blocks in ``skip_mmdit`` / ``skip_dit`` skipped as the stock forward
    skips them, ControlNet additions as Chroma makes them."""

    fp16_clean = False

    @staticmethod
    def add_control_input(img: torch.Tensor, add: torch.Tensor) -> None:
        img += add

    @staticmethod
    def add_control_output(hidden: torch.Tensor, text: int, add: torch.Tensor) -> None:
        hidden[:, text:, ...] += add

    @staticmethod
    def problem(model: Any, call: dict) -> str | None:
        x = call.get("x")
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            return "x is not [batch, channels, height, width]"
        if not hasattr(model, "final_layer"):
            return "the model has no final layer (its forward returns the rows)"
        return None

    @staticmethod
    def conditioning(model: Any, call: dict, dtype: torch.dtype, img_ids: torch.Tensor, txt_ids: torch.Tensor):
        """The distilled guidance layer's modulation vectors, text rows and rope as forward_orig builds them, in the
        image rows' ``dtype``."""
        from comfy.ldm.chroma.model import timestep_embedding
        timestep, guidance, context = call["timestep"], call["guidance"], call["context"]
        bs, device, length = img_ids.shape[0], txt_ids.device, 344
        distill_timestep = timestep_embedding(timestep.detach().clone(), 16).to(device, dtype)
        distil_guidance = timestep_embedding(guidance.detach().clone(), 16).to(device, dtype)
        index = timestep_embedding(torch.arange(length, device=device), 32).to(device, dtype)
        index = index.unsqueeze(0).repeat(bs, 1, 1).to(device, dtype)
        timestep_guidance = torch.cat([distill_timestep, distil_guidance], dim=1).unsqueeze(1).repeat(
            1, length, 1).to(dtype).to(device, dtype)
        mod_vectors = model.distilled_guidance_layer(torch.cat([timestep_guidance, index], dim=-1).to(device, dtype))
        del timestep_guidance, index
        txt = model.txt_in(context)
        pe = model.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))
        return mod_vectors, txt, pe

    @classmethod
    def forward(cls, model: Any, call: dict, state: Any) -> torch.Tensor:
        import comfy.ldm.common_dit as common_dit
        from einops import rearrange, repeat

        x, context = call["x"], call["context"]
        control, options = call.get("control"), call.get("transformer_options", {})
        mask = (call.get("kwargs") or {}).get("attention_mask")
        bs, _, h, w = x.shape
        p = model.patch_size
        x = common_dit.pad_to_patch_size(x, (p, p))
        patches = rearrange(x, "b c (h ph) (w pw) -> b (h w) (c ph pw)", ph=p, pw=p)
        h_len, w_len = (h + (p // 2)) // p, (w + (p // 2)) // p
        img_ids = torch.zeros((h_len, w_len, 3), device=x.device, dtype=x.dtype)
        img_ids[:, :, 1] = img_ids[:, :, 1] + torch.linspace(0, h_len - 1, steps=h_len, device=x.device,
                                                             dtype=x.dtype).unsqueeze(1)
        img_ids[:, :, 2] = img_ids[:, :, 2] + torch.linspace(0, w_len - 1, steps=w_len, device=x.device,
                                                             dtype=x.dtype).unsqueeze(0)
        img_ids = repeat(img_ids, "h w c -> b (h w) c", b=bs)
        txt_ids = torch.zeros((bs, context.shape[1], 3), device=x.device, dtype=x.dtype)
        options = options.copy()   # as forward_orig
        buf, chunk, (mod_vectors, txt, pe) = cls.embed(model, call, state, patches, img_ids, txt_ids)
        text = txt.shape[1]
        del patches

        def vecs(kind: str, i: int):
            if kind == "double":
                return None if i in model.skip_mmdit else (model.get_modulations(mod_vectors, "double_img", idx=i),
                                                           model.get_modulations(mod_vectors, "double_txt", idx=i))
            return None if i in model.skip_dit else model.get_modulations(mod_vectors, "single", idx=i)

        hidden = cls.blocks(model, buf, txt, vecs, pe, mask, options, control, state, chunk)
        del buf, txt, pe
        out = cls.head(model, hidden[:, text:], model.get_modulations(mod_vectors, "final"), chunk, state)
        del hidden
        return rearrange(out, "b (h w) (c ph pw) -> b c (h ph) (w pw)", h=h_len, w=w_len, ph=p,
                         pw=p)[:, :, :h, :w]
