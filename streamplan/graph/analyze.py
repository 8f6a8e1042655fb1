"""Row-space analysis of a captured graph: for every value, its row (token) dimension and where the dynamic rows sit
among static ones; every op classified row-local, global (attention over the rows' K/V) or unknown.

A value's rows are ``pre`` static rows, then the dynamic rows (the call's row count, chunked), then ``post`` static
rows: text rows joined to image rows by ``cat`` are static, computed whole in every chunk. Anything outside the
rules below (a reduction over rows, a gather along rows, positions built from the row count, random ops, a second
row source) makes the whole block stay stock, with the op named.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import fx

from ..registries import ROW_CONTRACTION_OPS, ROW_LOCAL_CUSTOM_OPS
from .op_names import REDUCE_OPS, NotRowLocal, op_name, pointwise
from .pair_masks import NotSliceable, PairMask, is_pair_op, pair_mask
from .grid_rows import CONV_OPS, GridConvRefused, grid_conv_halo, grid_cut, lines_unit, whole_slice

aten = torch.ops.aten


@dataclass(frozen=True)
class Rows:
    """Where a tensor's rows are: dimension ``dim``; ``pre`` static rows, the dynamic rows, ``post`` static rows."""

    dim: int
    pre: int = 0
    post: int = 0
    unit: int = 1    # rows per index of ``dim``: >1 where the rows are whole lines of a grid (``grid_rows``), the rest
    # of a line in other dimensions
    outer: int = 1   # a static extent merged in front of a grid's lines in ``dim`` (``view(batch * frames, ...)``):
    # that many runs of lines one after another (only where ``unit`` > 1)


@dataclass(eq=False)
class GlobalAttention:
    """An attention whose keys and values span the rows: K and V are built whole first, Q runs in chunks."""

    node: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    causal: bool
    scale: float | None
    kv_rows: Rows
    q_rows: Rows | None
    mask: fx.Node | None = None      # an input mask over the rows' keys: [.., 1, Nk] whole per chunk, or [.., N, Nk]
    mask_query_rows: bool = False    # its query rows are the rows (each Q chunk takes its own), keys whole
    softcap: float = 0.0             # scores soft-capped as c * tanh(s / c) (hand-written attention; 0: none)
    sinks: fx.Node | None = None     # a logit per head in each row's softmax, no value (no rows)


@dataclass(eq=False)
class Analysis:
    rows: dict[fx.Node, Any]                 # Rows, a list of Rows|None for tuples, or None (no dynamic rows)
    const: set[fx.Node]                      # values that do not depend on the rows: computed once per call
    ignored: set[fx.Node]                    # the trace's own assertions: not run
    attentions: list[GlobalAttention]
    outputs: list[Any]                       # the output node's flat arguments
    ops: int = 0
    notes: list[str] = field(default_factory=list)
    input_writes: set = field(default_factory=set)   # in-place writes into the block's own inputs (as stock does)
    whole_inputs: set = field(default_factory=set)   # inputs with rows every chunk takes whole (a key mask)
    built_whole: set = field(default_factory=set)    # values with rows built from the row count alone (a key mask
    # built inside the block, positions): computed once per call over every row, then read like inputs
    pair_masks: dict = field(default_factory=dict)   # masks over rows x rows built inside the block: each Q chunk's
    # rows built alone from values read whole (``pair_masks.PairMask``), then read like a mask input's rows
    halo: tuple[int, int] = (0, 0)   # rows before and after its own that a chunk reads (convolutions along the rows):
    # each chunk runs on its rows widened by them, and keeps its own
    contractions: list = field(default_factory=list)   # ops contracting over every row (``row_contractions``):
    # computed in phase KV from their inputs built whole, then read by every Q chunk as an input is
    fixed_cuts: dict = field(default_factory=dict)   # cuts along the rows at a fixed count -> ``FixedCut``: each chunk
    # takes its part of every side (``fixed_row_slices``); ``fixed_joins`` the cats that join the sides back
    fixed_joins: set = field(default_factory=set)
    halo_nodes: set = field(default_factory=set)   # the ops that read a halo of rows (phase KV may not run them)
    reduced: list = field(default_factory=list)   # global attentions of fixed queries reduced over phase Q's chunks
    # (``reduced_attentions``): not among ``attentions``

    @property
    def read_as_inputs(self) -> set:
        """Values the chunks read as they read the block's inputs, never computing them in a phase."""
        return set(self.built_whole) | set(self.pair_masks) | {c.node for c in self.contractions}

    @property
    def static_rows(self) -> bool:
        """Whether some value has static rows joined to the dynamic ones (text rows beside image rows): a phase
        computes those once, not per chunk."""
        return any(r.pre or r.post for v in self.rows.values() for r in (v if isinstance(v, list) else [v])
                   if isinstance(r, Rows))


IGNORED_OPS = {aten._assert_tensor_metadata.default, aten._assert_scalar.default,
            aten.sym_constrain_range_for_size.default}
_PASS = {"view", "reshape", "_unsafe_view", "unflatten", "flatten", "permute", "transpose", "t", "unsqueeze", "squeeze",
         "expand", "expand_as", "broadcast_to", "alias", "clone", "contiguous", "_to_copy", "to", "type_as", "detach",
         "lift_fresh_copy",
         "view_as_complex", "view_as_real", "movedim", "dropout", "native_dropout", "fill", "zeros_like", "ones_like",
         "empty_like", "full_like", "masked_fill", "where", "real", "imag", "conj", "_conj", "resolve_conj",
         "resolve_neg", "stack", "repeat_interleave", "copy"}
# ops whose output shares its input's storage (a write into one reaches the other; the memory model counts no bytes)
VIEW_OPS = {"view", "_unsafe_view", "permute", "transpose", "t", "unsqueeze", "squeeze", "expand", "expand_as",
            "broadcast_to", "alias",
            "slice", "select", "narrow", "split", "split_with_sizes", "chunk", "unbind", "unflatten", "detach",
            "movedim", "view_as_complex", "view_as_real", "flatten", "reshape", "contiguous", "dropout",
            "lift_fresh_copy"}
_RESHAPES = {"view", "reshape", "_unsafe_view", "unflatten", "flatten"}
_DIMMED = {"slice", "narrow", "select", "split", "split_with_sizes", "chunk", "unbind", "cat", "concat", "index_select",
           "tensor_split"}
_SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax", "cumsum", "cumprod"}
_NORMS = {"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"}
MATMUL_OPS = {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm"}
_CREATE = {"new_zeros", "new_ones", "new_full", "new_empty", "zeros", "ones", "full", "empty"}
# dtype conversions: a new tensor where the dtype changes, the input itself (or an alias) where it does not
DTYPE_CONVERSIONS = ("to", "_to_copy", "type_as")
# ops that make a fresh buffer of their own (nothing read but shapes, dtypes, a fill value)
FRESH_BUFFERS = _CREATE | {"empty_like", "zeros_like", "ones_like", "full_like", "empty_strided"}
SDPA_OPS = {"scaled_dot_product_attention", "eager_attention",   # the second: graph/eager_attention.py
            "flex_block_attention"}   # attention.flex: a flex mask of full blocks held as its tables


def numel_besides(val, dim: int | None) -> int:
    """Elements of ``val`` per index of dimension ``dim`` (all of them for None); 0 where a size is symbolic."""
    n = 1
    for i, size in enumerate(val.shape):
        if i == dim:
            continue
        e = size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)
        if not e.is_Integer:
            return 0
        n *= int(e)
    return n


def written_args(node: fx.Node) -> list[fx.Node]:
    """The arguments an op writes into, by its schema (``Tensor(a!)``): an in-place op's first, or several (a fused
    kernel that updates Q and K in place)."""
    schema = getattr(node.target, "_schema", None)
    out = []
    for i, a in enumerate(schema.arguments if schema is not None else ()):
        if a.alias_info is not None and a.alias_info.is_write:
            v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
            if isinstance(v, fx.Node):
                out.append(v)
    return out


def writes_in_place(n: fx.Node) -> bool:
    """``n`` writes into a value it was given: an in-place op (its name ends in ``_``) or one whose schema marks an
    argument written."""
    return n.op == "call_function" and n.target is not operator.getitem and (
        op_name(n.target).endswith("_") or bool(written_args(n)))


def bind(node: fx.Node) -> dict[str, Any]:
    """An ATen call's arguments by schema name, defaults filled."""
    schema = node.target._schema
    out: dict[str, Any] = {}
    for i, a in enumerate(schema.arguments):
        if i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            out[a.name] = None
    return out


class _Analyzer:
    def __init__(self, graph: fx.Graph, symbol, user_inputs: set[fx.Node], post_inputs: frozenset = frozenset(),
                 unit: int = 1, cuts: Any = None):
        self.s = symbol
        self.unit = unit           # rows per step of the symbol: the row count is ``unit * symbol`` (a grid)
        self.count = unit * symbol
        self.outer = 1   # the static extent merged in front of a grid's lines in the current op's output (``Rows``)
        self.contractions: list = []   # ``row_contractions.RowContraction``
        self.halo_nodes: set[fx.Node] = set()   # ops that read rows around their own
        self.cuts = cuts   # what reads cuts along the rows at a fixed count (``fixed_row_slices``), or None
        self.fixed_cuts: dict[fx.Node, Any] = {}    # those cuts -> ``FixedCut``
        self.fixed_joins: set[fx.Node] = set()
        self.graph = graph
        self.user_inputs = user_inputs
        self.post_inputs = post_inputs    # inputs with static rows whose static rows come after the dynamic ones
        self.joined: set[fx.Node] = set()
        self.rows: dict[fx.Node, Any] = {}
        self.const: set[fx.Node] = set()
        self.attentions: list[GlobalAttention] = []
        self.ignored: set[fx.Node] = set()
        self.input_writes: set[fx.Node] = set()
        self.masks: dict[fx.Node, Rows] = {}   # inputs over rows x rows (attention masks): their key dimension
        # values with rows that depend on no row of any input (built from the row count: a key mask of ones over the
        # image rows, positions): each can be built once over every row; ``from_count`` those of them a chunk could
        # not build by itself (arange, pad: values that differ by row), which must be built whole
        self.row_const: set[fx.Node] = set()
        self.from_count: dict[fx.Node, str] = {}
        self.whole_masks: set[fx.Node] = set()
        self.pair_nodes: set[fx.Node] = set()        # values with two row dimensions on the way to an attention mask
        self.pair_masks: dict[fx.Node, PairMask] = {}
        # convolutions along the rows: each output row reads a reach of input rows around its own (a halo), so a chunk
        # runs on its rows and the halo's; ``halo`` the reach of the whole block (left, right), every such op's added.
        # ``halo_wide`` a padded convolution's output longer than the rows, and how much, until a slice takes them
        self.halo = (0, 0)
        self.shared_writes: list[str] = []   # in-place ops writing per-chunk values into values computed once
        self.halo_wide: dict[fx.Node, tuple[int, int, int]] = {}   # node -> (padding, dilation * (kernel - 1), extra)

    # -- symbolic helpers ---------------------------------------------------------------------------------------
    def expr(self, size) -> sympy.Expr:
        if isinstance(size, torch.SymInt):
            return size.node.expr
        if isinstance(size, fx.Node):
            return self.expr(size.meta["val"])
        return sympy.Integer(int(size))

    def row_dims(self, val) -> list[tuple[int, int]]:
        """(dim, static rows) of every dimension whose size holds the row count; a size that is not rows + a
        constant is refused."""
        found = []
        for i, size in enumerate(val.shape):
            e = self.expr(size)
            if self.s in e.free_symbols:
                if self.outer > 1:   # whole lines of each of the merged runs, or refused
                    if not lines_unit(e, self.s, self.unit, self.outer):
                        raise NotRowLocal(f"a dimension of size {e}: a static dimension merged with the rows other "
                                          f"than in front of whole lines of their grid")
                    found.append((i, 0))
                    continue
                c = sympy.expand(e - self.count)
                if not c.is_Integer and self.unit > 1 and lines_unit(e, self.s, self.unit):
                    found.append((i, 0))   # whole lines of a grid: ``out_rows`` gives their unit
                    continue
                if not c.is_Integer or int(c) < 0:
                    raise NotRowLocal(f"a dimension of size {e} (not the row count plus a constant)")
                found.append((i, int(c)))
        return found

    def two_row_dims(self, val) -> bool:
        """Whether ``val`` has two dimensions that hold the row count (a size other than rows + a constant is the
        op's own check to name)."""
        try:
            return len(self.row_dims(val)) == 2
        except NotRowLocal:
            return False

    def out_rows(self, node: fx.Node, val, pre: int, post: int) -> Rows | None:
        dims = self.row_dims(val)
        if not dims:
            return None
        if len(dims) > 1:
            raise NotRowLocal(f"{op_name(node.target)} gives a value with two row dimensions")
        dim, c = dims[0]
        if c != pre + post:
            raise NotRowLocal(f"{op_name(node.target)}: static rows do not add up ({c} vs {pre}+{post})")
        unit = lines_unit(self.expr(val.shape[dim]), self.s, self.unit, self.outer) if self.unit > 1 else None
        if unit is not None:
            if pre or post:   # the rest of a line may lie in any other dimensions (``grid_rows``)
                raise NotRowLocal(f"{op_name(node.target)} joins static rows to a grid's lines")
            return Rows(dim, unit=unit, outer=self.outer)
        return Rows(dim, pre, post)

    def in_rows(self, node: fx.Node) -> list[tuple[fx.Node, Rows]]:
        found = []
        for arg in node.all_input_nodes:
            r = self.rows.get(arg)
            if isinstance(r, Rows):
                found.append((arg, r))
            elif isinstance(r, list):
                raise NotRowLocal(f"{op_name(node.target)} takes a tuple with rows")
        return found

    def norm_dim(self, dim: int, ndim: int) -> int:
        return dim + ndim if dim < 0 else dim

    # -- the walk -----------------------------------------------------------------------------------------------
    def run(self) -> None:
        for node in self.graph.nodes:
            self.outer = 1
            if node.op == "placeholder":
                self.placeholder(node)
            elif node.op == "call_function" and self.cuts is not None and self.cuts.reads_span(self, node):
                self.rows[node] = self.cuts.through(self, node)   # a side of rows cut at a fixed count, or the join
            elif node.op == "call_function":
                self.call(node)
            elif node.op == "get_attr":
                raise NotRowLocal(f"a higher-order op over a subgraph ({node.target}: an autocast region or control "
                                  f"flow), which the generic path does not run")
            elif node.op != "output":
                raise NotRowLocal(f"graph node of kind {node.op}")

    def placeholder(self, node: fx.Node) -> None:
        val = node.meta.get("val")
        if node not in self.user_inputs or not isinstance(val, torch.Tensor):
            self.const.add(node)
            self.rows[node] = None
            return
        dims = self.row_dims(val)
        if len(dims) == 2 and [d for d, _ in dims] == [val.dim() - 2, val.dim() - 1] and not dims[0][1] \
                and not dims[1][1]:   # [.., N, N]: an attention mask over rows x rows, its query rows chunked
            self.rows[node] = Rows(val.dim() - 2)
            self.masks[node] = Rows(val.dim() - 1)
            return
        if len(dims) > 1:
            raise NotRowLocal(f"input {node.name} has {len(dims)} row dimensions (a mask over rows x rows?)")
        if dims and self.unit > 1 and lines_unit(self.expr(val.shape[dims[0][0]]), self.s, self.unit):
            raise NotRowLocal(f"input {node.name} is laid out by lines of the rows' grid")
        if dims and dims[0][1]:   # rows joined to static ones (a table over text + image rows): side guessed
            c = dims[0][1]
            self.rows[node] = Rows(dims[0][0], 0, c) if node in self.post_inputs else Rows(dims[0][0], c, 0)
            self.joined.add(node)
            return
        self.rows[node] = Rows(dims[0][0]) if dims else None
        if not dims:
            self.const.add(node)

    def call(self, node: fx.Node) -> None:
        target = node.target
        if target in IGNORED_OPS:   # checks of the trace's own assumptions: not run
            self.rows[node] = None
            self.ignored.add(node)
            return
        masks = [a for a in node.all_input_nodes if a in self.masks]
        pairs = [a for a in node.all_input_nodes if a in self.pair_nodes or a in self.masks]
        if pairs and op_name(target) != "sym_size" and (op_name(target) not in SDPA_OPS
                                                        or pairs != [bind(node).get("attn_mask")]):
            self.pair(node)   # a mask over rows x rows on its way to an attention
            return
        if masks and op_name(target) == "sym_size":
            # export may read the row count off a mask (OmniGen): off its key dimension, which a Q chunk keeps
            # whole, it is read off the query dimension instead (the same symbol), so it counts the chunk's rows
            m = node.args[0]
            if self.norm_dim(node.args[1], m.meta["val"].dim()) == self.masks[m].dim:
                node.args = (m, self.rows[m].dim)
        elif masks and (op_name(target) not in SDPA_OPS or masks != [bind(node).get("attn_mask")]):
            raise NotRowLocal(f"input {masks[0].name} over rows x rows used other than as an attention's mask")
        if all(a in self.const for a in node.all_input_nodes) and not self.random(node):
            self.const.add(node)
        val = node.meta.get("val")
        name = op_name(target)
        if target is operator.getitem:
            src = self.rows.get(node.args[0])
            if isinstance(src, Rows):
                raise NotRowLocal("getitem on a tensor with rows")
            self.rows[node] = src[node.args[1]] if isinstance(src, list) else None
            return
        if not isinstance(target, torch._ops.OpOverload):
            if self.in_rows(node):
                raise NotRowLocal(f"call of {name} on values with rows")
            self.rows[node] = None
            return
        if self.random(node):
            raise NotRowLocal(f"random op {name}")
        inputs = self.in_rows(node)
        outers = {r.outer for _, r in inputs}
        if len(outers) > 1:
            raise NotRowLocal(f"{name} joins a grid's lines merged with a static dimension to lines merged otherwise")
        self.outer = outers.pop() if outers else 1
        if (getattr(target, "namespace", None), name) in ROW_CONTRACTION_OPS and inputs:
            self.rows[node] = custom_contraction(self, node, name, inputs, val)
            return
        kind = ROW_LOCAL_CUSTOM_OPS.get((getattr(target, "namespace", None), name))
        if kind is not None and inputs:
            self.rows[node] = self.custom_row_local(node, kind, name, inputs, val)
            return
        if name in SDPA_OPS:
            self.rows[node] = self.attention(node, val)
            return
        if not inputs and node not in self.const and written_args(node):
            self.shared_write(node, name)
        if not inputs:
            if isinstance(val, torch.Tensor) and self.row_dims(val):
                if name not in _CREATE and name not in ("expand", "expand_as"):
                    self.from_count[node] = f"{name} builds per-row values from the row count (positions?)"
                # a creation's static rows are none; a value that differs by row may have some first (a text mask
                # padded by the image rows)
                pre = 0 if node not in self.from_count else self.row_dims(val)[0][1]
                self.rows[node] = self.out_rows(node, val, pre, 0)
                self.row_const.add(node)
            else:
                self.rows[node] = None
            return
        args = bind(node)
        if name.endswith("_") and node.target._schema.arguments and node.target._schema.arguments[0].alias_info \
                and node.target._schema.arguments[0].alias_info.is_write:
            self.rows[node] = self.in_place(node, name, inputs, val)
            return
        if any(r.unit > 1 for _, r in inputs) and (name in _DIMMED or name in ("pad", "constant_pad_nd")):
            kept = whole_slice(self, name, args, inputs, val)
            if kept is not None:   # a slice that keeps every line: the value itself
                self.rows[node] = kept
                return
            grid_cut(self, name, args, inputs)
        if isinstance(val, (tuple, list)):
            self.rows[node] = self.multi(node, name, args, inputs, val)
            return
        if not isinstance(val, torch.Tensor):
            if name == "sym_size":
                self.rows[node] = None
                return
            raise NotRowLocal(f"{name} turns rows into a non-tensor")
        if is_pair_op(node) and self.two_row_dims(val):   # a key mask over the rows spread over rows x rows
            self.pair(node)
            return
        if name in CONV_OPS and inputs and (inputs[0][1].unit > 1 or inputs[0][1].dim != 2 or
                                            inputs[0][0].meta["val"].dim() != 3):
            self.rows[node] = self.grid_conv(node, name, args, inputs, val)
            return
        if name in ("conv1d", "convolution"):
            self.rows[node] = self.halo_conv(node, name, args, inputs, val)
            return
        if name in MATMUL_OPS or name in REDUCE_OPS or name in ("pad", "constant_pad_nd"):
            handled = contraction_or_row_local(self, node, name, args, inputs, val)
            if handled is not NOT_HANDLED:
                self.rows[node] = handled
                return
        if any(n in self.halo_wide for n, _ in inputs):
            self.rows[node] = self.halo_crop(node, name, args, inputs, val)
            return
        self.rows[node] = self.single(node, name, args, inputs, val)
        if all(n in self.row_const or n in self.const or not isinstance(n.meta.get("val"), torch.Tensor)
               for n in node.all_input_nodes):
            self.row_const.add(node)

    def custom_row_local(self, node: fx.Node, kind: str, name: str, inputs: list, val: Any) -> Any:
        """A custom op a library declared row-local: "norm", over a row's features (never over the rows); "rows",
        every output its inputs' rows (a fused kernel may write into its inputs)."""
        pre, post = self.same_layout(name, inputs)
        if kind == "norm":
            x_node, x = inputs[0]
            if x_node is not node.args[0] or x.dim == x_node.meta["val"].dim() - 1:
                raise NotRowLocal(f"{name} over the rows")
            out = self.out_rows(node, val, pre, post)
            for n, r in inputs:
                if out is None or n.meta["val"].dim() - r.dim != val.dim() - out.dim:
                    raise NotRowLocal(f"{name} broadcasts rows against another dimension")
            return out
        vals = list(val) if isinstance(val, (tuple, list)) else [val]
        outs = [self.out_rows(node, v, pre, post) if isinstance(v, torch.Tensor) else None for v in vals]
        if any(o is None for o, v in zip(outs, vals) if isinstance(v, torch.Tensor)):
            raise NotRowLocal(f"{name} drops the rows")
        for w in written_args(node):   # an in-place kernel (comfy_kitchen's fused q/k norm + rope)
            self.written(node, w, name)
        return outs if isinstance(val, (tuple, list)) else outs[0]

    def pair(self, node: fx.Node) -> None:
        """A value with two row dimensions: element-wise or a layout change of values over the rows, on its way to be
        an attention's mask over rows x rows (``attention`` checks where it ends)."""
        val, name = node.meta.get("val"), op_name(node.target)
        if not isinstance(val, torch.Tensor) or not is_pair_op(node) or len(self.row_dims(val)) != 2:
            raise NotRowLocal(f"{name} on a mask over rows x rows, other than to make an attention's mask of it")
        self.pair_nodes.add(node)
        self.rows[node] = None

    def halo_conv(self, node: fx.Node, name: str, args: dict, inputs, val) -> Rows:
        """A 1-D convolution along the rows (a short causal convolution): stride 1, zero padding; its reach
        from the kernel size, padding and dilation, never guessed."""
        x_node, x = inputs[0]
        xv = x_node.meta["val"]
        if x_node is not args.get("input") or len(inputs) > 1 or xv.dim() != 3 or x.dim != 2 or x.pre or x.post:
            raise NotRowLocal(f"{name} over the rows other than a 1-D convolution along them (its input "
                              "[batch, channels, rows], the rows alone)")
        if args.get("transposed") or list(args.get("stride") or [1]) != [1]:
            raise NotRowLocal(f"{name} along the rows with a stride or transposed")
        w = args["weight"].meta["val"]
        reach = int(list(args.get("dilation") or [1])[0]) * (int(w.shape[-1]) - 1)
        padding = args.get("padding", [0])
        if padding == "same":
            left = reach // 2
        elif isinstance(padding, (list, tuple)) and len(padding) == 1 and isinstance(padding[0], int):
            left = int(padding[0])
        else:
            raise NotRowLocal(f"{name} along the rows with padding {padding!r}")
        extra = 2 * left - reach if padding != "same" else 0
        if extra < 0:
            raise NotRowLocal(f"{name} along the rows gives fewer rows than it reads (padding {left}, reach {reach})")
        out = self.out_rows(node, val, 0, extra)
        if out is None or out.dim != 2:
            raise NotRowLocal(f"{name} moves the rows")
        self.halo_nodes.add(node)
        if extra:   # padded both sides: longer than the rows until a slice keeps the rows' count of them
            self.halo_wide[node] = (left, reach, extra)
        else:
            self.add_halo(left, reach - left)
        return Rows(2)

    def grid_conv(self, node: fx.Node, name: str, args: dict, inputs, val) -> Rows:
        """A convolution whose input has its rows (or the grid's lines) along its batch or a spatial axis: none or a
        reach of whole lines around each of its own (``grid_rows.grid_conv_halo``)."""
        x_node, x = inputs[0]
        if x_node is not args.get("input") or len(inputs) > 1:
            raise NotRowLocal(f"{name} over the rows' grid whose weight or bias has rows")
        if x.pre or x.post:
            raise NotRowLocal(f"{name} over rows joined with static rows")
        try:
            left, right = grid_conv_halo(args, x.dim, x.unit, x_node.meta["val"].dim(), x.outer)
        except GridConvRefused as exc:
            raise NotRowLocal(str(exc)) from None
        out = self.out_rows(node, val, 0, 0)
        if out is None or out != x:
            raise NotRowLocal(f"{name} over the rows' grid moves its lines")
        if (left, right) != (0, 0):
            self.halo_nodes.add(node)
            self.add_halo(left, right)
        return out

    def halo_crop(self, node: fx.Node, name: str, args: dict, inputs, val) -> Rows:
        """The slice that keeps the row count of a padded convolution's longer output (``x[..., :rows]``: causal)."""
        x_node, _ = inputs[0]
        left, reach, extra = self.halo_wide[x_node]
        start = self.expr(args.get("start") or 0)
        dims = self.row_dims(val) if isinstance(val, torch.Tensor) else []
        if name != "slice" or x_node is not args.get("self") or len(inputs) > 1 or \
                self.norm_dim(args.get("dim", 0), val.dim()) != 2 or (args.get("step") or 1) != 1 or \
                not start.is_Integer or not 0 <= int(start) <= extra or dims != [(2, 0)]:
            raise NotRowLocal(f"{name} of a padded convolution's output other than a slice of the rows' count")
        self.add_halo(left - int(start), reach - left + int(start))
        return Rows(2)

    def add_halo(self, left: int, right: int) -> None:
        self.halo = (self.halo[0] + left, self.halo[1] + right)

    def shared_write(self, node: fx.Node, name: str) -> None:
        """An in-place op on values without rows that runs in every chunk (it reads an attention's output over
        static queries, say) must not write into a value computed once per call: each chunk would write it again.
        Where static rows are joined to the rows, such values are computed by the first chunk alone: ``analyze``
        refuses the write only without them."""
        for target in written_args(node):
            root = target
            while root.op == "call_function" and root.all_input_nodes and (
                    op_name(root.target) in VIEW_OPS or root.target is operator.getitem):
                root = root.all_input_nodes[0]
            if target in self.const or root in self.const:
                self.shared_writes.append(name)

    def in_place(self, node, name, inputs, val) -> Rows | None:
        """An op writing into its first argument (``copy_`` into a slice of a fresh tensor, ``mul_``): row-local when
        it writes rows into the same rows of a per-call value, never into a value shared by every chunk."""
        tr = self.written(node, node.args[0], name)
        pre, post = self.same_layout(name, inputs)
        for n, r in inputs:
            if n.meta["val"].dim() - r.dim != val.dim() - tr.dim:
                raise NotRowLocal(f"{name} writes rows into other rows")
        return Rows(tr.dim, pre, post, tr.unit, tr.outer)

    def written(self, node: fx.Node, target: fx.Node, name: str) -> Rows:
        """Where ``node`` writes into ``target`` in place: it must have rows and be a per-call value (a write into the
        block's own input is recorded); its rows."""
        tr = self.rows.get(target)
        if not isinstance(tr, Rows):
            raise NotRowLocal(f"{name} writes rows into a value without rows")
        root = target
        while root.op == "call_function" and root.all_input_nodes and (
                op_name(root.target) in VIEW_OPS or root.target is operator.getitem):
            root = root.all_input_nodes[0]
        if root in self.const or target in self.const:
            raise NotRowLocal(f"{name} writes into a value every chunk shares")
        if root in self.user_inputs:   # the block updates its input in place, as stock does, row by row
            if tr.pre or tr.post:
                raise NotRowLocal(f"{name} writes into an input joined with static rows")
            self.input_writes.add(node)
        return tr

    def random(self, node: fx.Node) -> bool:
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            return False
        if op_name(target) in ("dropout", "native_dropout"):
            a = bind(node)
            return bool(a.get("train")) and float(a.get("p") or 0) > 0
        if op_name(target) in SDPA_OPS:   # seeded only through its dropout, checked with the attention
            return False
        return torch.Tag.nondeterministic_seeded in target.tags

    def same_layout(self, name: str, inputs) -> tuple[int, int]:
        layouts = {(r.pre, r.post) for _, r in inputs}
        if len(layouts) != 1:
            raise NotRowLocal(f"{name} joins values whose static rows differ")
        return layouts.pop()

    def single(self, node, name, args, inputs, val) -> Rows | None:
        x_node, x = inputs[0]
        x_val = x_node.meta["val"]
        dim = args.get("dim")
        if name in _DIMMED and dim is not None and not isinstance(dim, (list, tuple)):
            d = self.norm_dim(dim, x_val.dim() if name not in ("cat", "concat") else val.dim())
            if name in ("cat", "concat") and any(isinstance(self.rows.get(t), Rows) and self.rows[t].dim == d
                                                  for t in args["tensors"]):
                return self.cat(node, args, d, val)
            if name in ("cat", "concat"):
                pre, post = self.same_layout(name, inputs)
                return self.out_rows(node, val, pre, post)
            if name == "index_select":
                idx = self.rows.get(args["index"])
                src = self.rows.get(args["self"])
                if isinstance(src, Rows) and src.dim == d:
                    raise NotRowLocal("index_select along the rows (a gather across rows)")
                if isinstance(idx, Rows):
                    if isinstance(src, Rows):
                        raise NotRowLocal("index_select of rows by per-row indices")
                    return self.out_rows(node, val, idx.pre, idx.post)
                return self.out_rows(node, val, x.pre, x.post)
            if d == x.dim:
                try:
                    return self.row_slice(node, name, args, x, x_val, val)
                except NotRowLocal as exc:   # a cut at a fixed count, joined back later (``fixed_row_slices``)
                    if self.cuts is None:
                        raise
                    return self.cuts.fixed_cut(self, node, name, args, x, x_val, val, exc)
        if name == "repeat_interleave":   # each row repeated along another dimension (rotary tables): row-local
            rdim = args.get("dim")
            if not isinstance(rdim, int) or self.norm_dim(rdim, x_val.dim()) == x.dim:
                raise NotRowLocal("repeat_interleave along the rows (or of the flattened rows)")
        if name in _DIMMED or name in _PASS or pointwise(node.target):
            pre, post = self.same_layout(name, inputs)
            if name in _RESHAPES:
                self.outer = self.reshaped_outer(name, x_val, x, val)
            out = self.out_rows(node, val, pre, post)
            if out is None:
                raise NotRowLocal(f"{name} drops the rows")
            if pointwise(node.target):
                for n, r in inputs:
                    if n.meta["val"].dim() - r.dim != val.dim() - out.dim:
                        raise NotRowLocal(f"{name} broadcasts rows against another dimension")
            return out
        if name == "repeat":   # tiling: row-local when the rows' dimension is repeated once (GQA's K/V heads)
            reps = list(args["repeats"])
            d = x.dim + len(reps) - x_val.dim()
            if not isinstance(reps[d], int) or reps[d] != 1:
                raise NotRowLocal("repeat along the rows")
            out = self.out_rows(node, val, x.pre, x.post)
            if out is None or out.dim != d:
                raise NotRowLocal("repeat moves the rows")
            return out
        if name in MATMUL_OPS:
            a = args.get("input", args.get("self"))
            other = [args.get(k) for k in ("weight", "other", "mat2", "bias", "batch2")
                     if isinstance(args.get(k), fx.Node)]
            if name in ("addmm", "baddbmm"):
                a = args.get("mat1", args.get("batch1"))
            if any(isinstance(self.rows.get(o), Rows) for o in other):
                raise NotRowLocal(f"{name} contracts over the rows (attention written by hand?)")
            ar = self.rows.get(a)
            if not isinstance(ar, Rows) or ar.dim == a.meta["val"].dim() - 1:
                raise NotRowLocal(f"{name} over the row dimension")
            return self.out_rows(node, val, ar.pre, ar.post)
        if name in _NORMS:
            shape = args.get("normalized_shape") or []
            if x.dim >= x_val.dim() - len(shape):
                raise NotRowLocal(f"{name} normalises over the rows")
            return self.out_rows(node, val, x.pre, x.post)
        if name in _SOFTMAX:
            if self.norm_dim(args["dim"], x_val.dim()) == x.dim:
                raise NotRowLocal(f"{name} along the rows")
            return self.out_rows(node, val, x.pre, x.post)
        if name in REDUCE_OPS:
            dims = args.get("dim")
            if dims is None:
                raise NotRowLocal(f"{name} over every dimension, the rows included")
            dims = [dims] if isinstance(dims, int) else list(dims)
            if x.dim in {self.norm_dim(d, x_val.dim()) for d in dims} or not dims:
                raise NotRowLocal(f"{name} over the rows")
            return self.out_rows(node, val, x.pre, x.post)
        if name == "index":
            return self.gather(args, val)
        if name == "embedding":
            idx = self.rows.get(args["indices"])
            if isinstance(self.rows.get(args["weight"]), Rows) or not isinstance(idx, Rows):
                raise NotRowLocal("embedding of rows")
            return self.out_rows(node, val, idx.pre, idx.post)
        if name in _CREATE:   # x.new_empty(shape), new_zeros, ...: a fresh tensor, nothing read from x's rows
            return self.out_rows(node, val, 0, 0)
        raise NotRowLocal(f"op {name} is not one streamplan knows to be row-local")

    def gather(self, args, val) -> Rows | None:
        """``table[idx]`` (``aten.index`` with one integer index tensor): rows of a table without rows picked per row
        (MiniMax-H3's AdaLN rows by each row's segment, ``scale[mod_rows]``) is row-local, like ``embedding``."""
        indices = list(args["indices"] or [])
        src = self.rows.get(args["self"])
        if isinstance(src, Rows):   # ``x[..., [-2], :]``: constant indices into dimensions after the rows pick
            at = [i for i, t in enumerate(indices) if t is not None]   # features (K out of a fused QKV)
            if at and at[0] > src.dim and at == list(range(at[0], at[-1] + 1)) and all(
                    indices[i] in self.const for i in at):
                out = self.out_rows(args["self"], val, src.pre, src.post)
                if out is not None and out.dim == src.dim:
                    return out
            raise NotRowLocal("index of a value with rows (a gather across rows)")
        if any(isinstance(self.rows.get(i), Rows) for i in indices[1:]) or not indices or \
                not isinstance(self.rows.get(indices[0]), Rows):
            raise NotRowLocal("index with per-row indices other than into the first dimension")
        if indices[0].meta["val"].dtype == torch.bool:
            raise NotRowLocal("index by a boolean mask over the rows")
        r = self.rows[indices[0]]
        out = self.out_rows(node=indices[0], val=val, pre=r.pre, post=r.post)
        if out is None or out.dim != r.dim:
            raise NotRowLocal("index moves the rows")
        return out

    def reshaped_outer(self, name: str, x_val, x: Rows, val) -> int:
        """The static extent merged in front of a grid's lines after a reshape: what the dimensions before the input's
        rows held (with what was merged in already) over what those before the output's rows hold. A reshape keeps
        each chunk's values where they are in the whole only when that is a whole count, and merges anything only in
        front of a grid's lines (``view(batch * frames, ...)``; the lines of each run stay whole)."""
        dims = [i for i, size in enumerate(val.shape) if self.s in self.expr(size).free_symbols]
        if len(dims) != 1:
            return x.outer   # ``out_rows`` names it
        outer = sympy.simplify(self.prefix(x_val, x.dim) * x.outer / self.prefix(val, dims[0]))
        if outer.is_Rational and 0 < outer < 1 and (1 / outer).is_Integer:   # ``view(b, k, -1, c)``, k fixed
            raise NotRowLocal(f"{name} splits the rows into {1 / outer} runs in front of them, a count the capture "
                              f"holds fixed (not one computed from the rows)")
        if not outer.is_Integer or int(outer) < 1 or (int(outer) > 1 and self.unit == 1):
            raise NotRowLocal(f"{name} mixes the rows with the dimensions before them")
        return int(outer)

    @staticmethod
    def prefix(val, dim: int):
        p = sympy.Integer(1)
        for size in val.shape[:dim]:
            p = p * (size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size))
        return sympy.expand(p)

    def cat(self, node, args, d, val) -> Rows | None:
        pre = post = 0
        seen = None
        for t in args["tensors"]:
            r = self.rows.get(t)
            if isinstance(r, Rows):
                if seen is not None:
                    raise NotRowLocal("cat joins two sources of dynamic rows")
                if r.dim != d:
                    raise NotRowLocal("cat joins rows along another dimension")
                seen = r
                pre += r.pre
                continue
            size = t.meta["val"].shape[d]
            if isinstance(size, torch.SymInt):
                raise NotRowLocal("cat with a symbolic non-row size")
            if seen is None:
                pre += int(size)
            else:
                post += int(size)
        if seen is None:
            return None
        return self.out_rows(node, val, pre, post + seen.post)

    def span_ok(self, x: Rows, start, length, val_rows: Rows | None, name: str) -> Rows | None:
        """A slice [start, start + length) of a value with rows x: all static rows on one side, or the dynamic rows
        kept whole."""
        start = sympy.expand(start)
        if val_rows is not None:
            if not start.is_Integer or int(start) > x.pre:
                raise NotRowLocal(f"{name} cuts into the dynamic rows")
            pre = x.pre - int(start)
            post = (val_rows.pre + val_rows.post) - pre
            if post < 0 or post > x.post:
                raise NotRowLocal(f"{name} cuts into the dynamic rows")
            return Rows(val_rows.dim, pre, post)
        end = sympy.expand(start + length)
        if start.is_Integer and end.is_Integer and 0 <= int(start) and int(end) <= x.pre:
            return None
        off = sympy.expand(start - self.count)
        if off.is_Integer and int(off) >= x.pre:
            return None
        raise NotRowLocal(f"{name} takes rows that include dynamic ones")

    def row_slice(self, node, name, args, x, x_val, val) -> Rows | None:
        size = self.expr(x_val.shape[x.dim])
        if name in ("slice",):
            if (args.get("step") or 1) != 1:
                raise NotRowLocal("a strided slice of the rows")
            start = self.expr(args.get("start") or 0)
            if (start.is_Integer and int(start) < 0) or (not start.is_Integer and bool(
                    start.subs(self.s, 10 ** 9) < 0)):   # from the end: ``freqs[-rows:]`` keeps every row
                start = sympy.expand(size + start)
            out_size = self.expr(val.shape[x.dim])
            return self.span_ok(x, start, out_size, self.out_rows_slice(node, val, x), name)
        if name == "narrow":
            start = self.expr(args["start"])
            return self.span_ok(x, start, self.expr(args["length"]), self.out_rows_slice(node, val, x), name)
        if name == "select":
            index = self.expr(args["index"])
            if index.is_Integer and int(index) < 0:
                index = size + index
            return self.span_ok(x, index, sympy.Integer(1), None, name)
        raise NotRowLocal(f"{name} along the rows")

    def out_rows_slice(self, node, val, x: Rows) -> Rows | None:
        dims = self.row_dims(val)
        if not dims:
            return None
        dim, c = dims[0]
        return Rows(dim, c, 0)   # pre is fixed by span_ok from the start offset; here c = pre + post

    def multi(self, node, name, args, inputs, val) -> list:
        x_node, x = inputs[0]
        x_val = x_node.meta["val"]
        dim = args.get("dim")
        d = self.norm_dim(dim, x_val.dim()) if isinstance(dim, int) else None
        if name in ("split", "split_with_sizes", "chunk", "unbind", "tensor_split") and d == x.dim:
            if name == "unbind":
                raise NotRowLocal("unbind along the rows")
            out, start = [], sympy.Integer(0)
            try:
                for item in val:
                    length = self.expr(item.shape[x.dim])
                    out.append(self.span_ok(x, start, length, self.out_rows_slice(node, item, x), name))
                    start = sympy.expand(start + length)
            except NotRowLocal as exc:   # a split at a fixed count, joined back later (``fixed_row_slices``)
                if self.cuts is None:
                    raise
                return self.cuts.fixed_cut(self, node, name, args, x, x_val, val, exc)
            return out
        if name in ("split", "split_with_sizes", "chunk", "unbind", "tensor_split") or name in _NORMS or \
                name in ("max", "min", "var_mean", "std_mean", "native_dropout", "sort", "topk"):
            if name in ("max", "min", "sort", "topk", "var_mean", "std_mean"):
                dims = args.get("dim")
                dims = [dims] if isinstance(dims, int) else list(dims or [])
                if not dims or x.dim in {self.norm_dim(q, x_val.dim()) for q in dims}:
                    raise NotRowLocal(f"{name} over the rows")
            if name in _NORMS:
                shape = args.get("normalized_shape") or []
                if x.dim >= x_val.dim() - len(shape):
                    raise NotRowLocal(f"{name} normalises over the rows")
            out = []
            for item in val:
                out.append(self.out_rows(node, item, x.pre, x.post) if isinstance(item, torch.Tensor) else None)
            return out
        raise NotRowLocal(f"op {name} (several outputs) is not one streamplan knows to be row-local")

    def attention(self, node: fx.Node, val) -> Rows | None:
        a = bind(node)
        q, k, v = a["query"], a["key"], a["value"]
        qr, kr, vr = self.rows.get(q), self.rows.get(k), self.rows.get(v)
        mask = a.get("attn_mask")
        if float(a.get("dropout_p") or 0) > 0:
            raise NotRowLocal("attention dropout")
        for t, r in ((q, qr), (k, kr), (v, vr)):
            if isinstance(r, Rows) and r.dim != t.meta["val"].dim() - 2:
                raise NotRowLocal("attention whose rows are not the sequence dimension of Q, K or V")
        if not isinstance(kr, Rows) and not isinstance(vr, Rows):   # cross-attention to static keys: row-local
            if a.get("is_causal") and isinstance(qr, Rows):
                raise NotRowLocal("causal attention of rows against static keys")
            if isinstance(mask, fx.Node) and isinstance(self.rows.get(mask), Rows):
                mr = self.rows[mask]
                if not isinstance(qr, Rows) or mr.dim != mask.meta["val"].dim() - 2 or (mr.pre, mr.post) != (
                        qr.pre, qr.post):
                    raise NotRowLocal("an attention mask whose rows are not the queries'")
            return self.out_rows(node, val, qr.pre, qr.post) if isinstance(qr, Rows) else None
        if not (isinstance(kr, Rows) and isinstance(vr, Rows)) or (kr.pre, kr.post) != (vr.pre, vr.post):
            raise NotRowLocal("attention whose K and V rows differ")
        if any(isinstance(r, Rows) and r.unit > 1 for r in (qr, kr, vr)):   # whole K/V buffers hold rows, not lines
            raise NotRowLocal("attention over the rows whose Q, K or V is laid out as the rows' grid (by lines)")
        by_query = False
        if mask is not None:
            by_query = self.global_mask(mask, qr, kr)
        causal = bool(a.get("is_causal"))
        if causal and (not isinstance(qr, Rows) or (qr.pre, qr.post, kr.pre, kr.post) != (0, 0, 0, 0)):
            raise NotRowLocal("causal attention over rows joined with static rows")
        sinks = a.get("sinks")
        if sinks is not None and (not isinstance(sinks, fx.Node) or sinks not in self.const):
            raise NotRowLocal("attention sinks that depend on the rows")
        self.attentions.append(GlobalAttention(node, q, k, v, causal, a.get("scale"), kr,
                                               qr if isinstance(qr, Rows) else None, mask, by_query,
                                               float(a.get("softcap") or 0.0), sinks))
        return self.out_rows(node, val, qr.pre, qr.post) if isinstance(qr, Rows) else None

    def global_mask(self, mask, qr, kr) -> bool:
        """A mask over the rows' keys the generic path takes (True: its query rows are the rows, chunked with Q): an
        input of the block given straight to the attention, either [.., 1, Nk] over the keys alone (whole for every Q
        chunk: a text mask over the joint rows) or [.., N, Nk] over rows x rows (no static rows)."""
        if isinstance(mask, fx.Node) and mask in self.pair_nodes:
            return self.pair_root(mask, qr, kr)
        if isinstance(mask, fx.Node) and any(c.node is mask for c in self.contractions):
            return False   # chosen from every row in phase KV (``row_contractions``): every Q chunk reads it whole
        built = isinstance(mask, fx.Node) and mask in self.row_const
        if not built and (not isinstance(mask, fx.Node) or mask.op != "placeholder" or mask not in self.user_inputs):
            return self.key_mask_made(mask, kr)
        if mask in self.masks:
            if not isinstance(qr, Rows) or (qr.pre, qr.post, kr.pre, kr.post) != (0, 0, 0, 0):
                raise NotRowLocal("a mask over rows x rows with static rows joined")
            return True
        self.key_mask(mask, kr, "an attention mask over the rows' keys whose layout is not [.., 1, keys] as K's rows",
                      f"input {mask.name}, an attention mask over the rows' keys, used otherwise too")
        if built:   # built once over every key, beside K and V
            self.whole_masks.add(mask)
        return False

    def key_mask_made(self, mask, kr) -> bool:
        """A key mask [.., 1, keys] the block makes from values read whole (the pipeline's [B, N] mask unsqueezed and
        cast): built whole for each Q chunk by its element-wise and layout ops alone (``pair_masks``), or refused."""
        if not isinstance(mask, fx.Node):
            raise NotRowLocal("an attention mask over the rows' keys that is not a tensor of the graph")
        self.key_mask(mask, kr, "an attention mask over the rows' keys built inside the block from its rows' values "
                                "(the generic path takes one given to the block, or built from the row count alone)",
                      "an attention mask over the rows' keys made inside the block and used otherwise too")
        try:
            self.pair_masks[mask] = pair_mask(mask, self.read_whole)
        except NotSliceable as exc:
            raise NotRowLocal(f"an attention mask over the rows' keys built inside the block: {exc}") from None
        return False

    def key_mask(self, mask: fx.Node, kr: Rows, layout: str, elsewhere: str) -> None:
        """A mask [.., 1, keys] over K's rows, every use of it an attention's mask: given whole to every Q chunk."""
        val, mr = mask.meta.get("val"), self.rows.get(mask)
        if val is None or not isinstance(mr, Rows) or mr.dim != val.dim() - 1 or val.dim() < 2 or \
                val.shape[-2] != 1 or (mr.pre, mr.post) != (kr.pre, kr.post):
            raise NotRowLocal(layout)
        if any(op_name(u.target) not in SDPA_OPS or bind(u).get("attn_mask") is not mask for u in mask.users):
            raise NotRowLocal(elsewhere)
        self.masks[mask] = mr

    def read_whole(self, n: fx.Node) -> bool:
        """Whether a mask built per chunk reads ``n`` whole: an input, a constant, a value built over every row."""
        return n.op == "placeholder" or n in self.const or (n in self.row_const and isinstance(self.rows.get(n), Rows))

    def pair_root(self, mask: fx.Node, qr, kr) -> bool:
        """A mask over rows x rows built inside the block, its query rows those of Q and its keys those of K: each Q
        chunk's rows are built alone (``pair_masks``) from values read whole."""
        val = mask.meta["val"]
        dims = self.row_dims(val)
        if not isinstance(qr, Rows) or [d for d, _ in dims] != [val.dim() - 2, val.dim() - 1] or \
                (dims[0][1], dims[1][1]) != (qr.pre + qr.post, kr.pre + kr.post):
            raise NotRowLocal("a mask over rows x rows whose dimensions are not the queries' and the keys' rows")
        try:
            self.pair_masks[mask] = pair_mask(mask, self.read_whole)
        except NotSliceable as exc:
            raise NotRowLocal(str(exc)) from None
        self.rows[mask] = Rows(val.dim() - 2, qr.pre, qr.post)
        return True

    def built_whole(self) -> set[fx.Node]:
        """The values built once per call over every row: key masks built from the row count, and the outermost
        values built from the row count alone that a chunk reads (sliced to its rows, as an input is). A value a chunk
        could not build by itself (``from_count``) must lie under one of them."""
        whole = set(self.whole_masks) | {n for pm in self.pair_masks.values() for n in pm.leaves if n in self.row_const}
        for n in self.row_const:
            if n in whole or isinstance(self.rows.get(n), list):
                continue
            users = [u for u in n.users if u not in self.ignored]
            if any(u not in self.row_const for u in users) and (n in self.from_count or any(
                    m in self.from_count for m in _upstream(n, self.row_const))):
                whole.add(n)
        covered = set(whole)
        for n in whole:
            covered |= _upstream(n, self.row_const)
        for n, why in self.from_count.items():
            if n not in whole and (n not in covered or _read_by_chunks(n, covered, whole, self.ignored)):
                raise NotRowLocal(why)
        return whole


def _upstream(node: fx.Node, within: set[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [m for m in node.all_input_nodes if m in within]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(x for x in m.all_input_nodes if x in within)
    return seen


def _read_by_chunks(node: fx.Node, covered: set[fx.Node], whole: set[fx.Node], ignored: set[fx.Node]) -> bool:
    """Whether anything a chunk runs reads ``node`` other than through a value built whole."""
    todo, seen = list(node.users), set()
    while todo:
        u = todo.pop()
        if u in seen or u in whole or u in ignored:
            continue
        seen.add(u)
        if u not in covered:
            return True
        todo.extend(u.users)
    return False


def analyze(graph: fx.Graph, symbol, user_inputs: set[fx.Node], unit: int = 1, cuts: Any = None) -> Analysis | str:
    """The analysis, or why this graph cannot run in row chunks (``unit``: rows per step of ``symbol``, a grid;
    ``cuts``: what takes cuts along the rows at a fixed count, ``fixed_row_slices``, which imports this module)."""
    an = _Analyzer(graph, symbol, user_inputs, unit=unit, cuts=cuts)
    try:
        an.run()
    except NotRowLocal as exc:
        if not an.joined:
            return str(exc)
        # an input with static rows joined to the dynamic ones: its static rows first failed, so try them last
        an = _Analyzer(graph, symbol, user_inputs, frozenset(an.joined), unit=unit, cuts=cuts)
        try:
            an.run()
        except NotRowLocal:
            return str(exc)
    output = next(n for n in graph.nodes if n.op == "output")
    outs = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    for o in outs:
        if isinstance(o, fx.Node) and isinstance(an.rows.get(o), list):
            return "an output is a tuple with rows"
        if isinstance(o, fx.Node) and getattr(an.rows.get(o), "unit", 1) > 1:
            return "an output laid out as the rows' grid (lines by width)"
    try:
        built = an.built_whole()
    except NotRowLocal as exc:
        return str(exc)
    if any(o in an.halo_wide for o in outs):
        return "a padded convolution's output, longer than the rows, is an output"
    ops = sum(1 for n in graph.nodes if n.op == "call_function")
    result = Analysis(an.rows, an.const, an.ignored, an.attentions, outs, ops, input_writes=an.input_writes,
                      whole_inputs={a.mask for a in an.attentions if a.mask is not None and not a.mask_query_rows},
                      built_whole=built, pair_masks=an.pair_masks, halo=an.halo, contractions=an.contractions,
                      fixed_cuts=an.fixed_cuts, fixed_joins=an.fixed_joins,
                      halo_nodes=set(an.halo_nodes))
    why = cuts.problem(an, outs) if cuts is not None else None
    if why is not None:
        return why
    if an.shared_writes and not result.static_rows:
        return (f"{an.shared_writes[0]} writes into a value computed once per call (no rows) from values each chunk "
                "computes: every chunk would write it again")
    if an.halo != (0, 0) and (result.static_rows or an.input_writes):
        return ("a convolution along the rows in a block with " + ("static rows joined" if result.static_rows else
                "writes into its inputs") +
                ": a chunk widened by its halo is run only where it reads nothing but its rows")
    if unit > 1 and result.static_rows:   # sizes counting a chunk's lines are not its rows
        return "rows on a grid with static rows joined to them"
    return result   # what phase KV may compute is checked on its phases (``contraction_phases.phase_kv_problem``)


from .row_contractions import NOT_HANDLED, contraction_or_row_local, custom_contraction  # noqa: E402 (uses the above)
