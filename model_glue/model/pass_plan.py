"""A pass's plan: every choice that fixes its dispatches, made once when the pass is submitted
(LlamaModel.plan_pass, by model_glue.policy's rules); model_glue.model.forward reads only the plan.

No numpy and no TVM: the same code runs in Pyodide and natively.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from contract.attention import MATRIX_PREFILL, AttentionChoice
from contract.kernels import PREFILL_TOKEN_TILE, SHORT_PREFILL_TOKENS, Int8XForm

# A prefill pass's attention on subgroup matrices (kernels.prefill_attention_matrix)
PREFILL_ON_MATRICES = AttentionChoice("prefill", MATRIX_PREFILL)
# A timed step whose split attention call is merged by the o-projection or its quantizer
O_MERGE_NOTE = "the split attention's merge ran inside the o-projection, not in attention_ms"
QUANTIZER_MERGE_NOTE = "the split attention's merge ran inside the o-projection's int8 quantizer, not in attention_ms"


@dataclass(frozen=True)
class PassPlan:
    """What a pass of n tokens dispatches. `key` names the dispatches a bound plan and its recording
    serve: n and the split count S are per-step values, so one bound plan serves every S and every
    prefill pass of the same builds."""

    n: int
    attention: AttentionChoice  # the causal prefill kernel, or a decode nest over a batch of prefixes
    greedy: bool  # argmax, else the sampler
    fold_norms: bool  # RMSNorm and SwiGLU folded into the matmuls (RunOptions.fold_norms)
    one_pass: bool = False  # one compute pass, attention untimed (RunOptions.time_attention_every)
    o_merges: bool = False  # the o-projection merges the split call's partial states
    quantizer_merges: bool = False  # ... or the o-projection's int8 quantizer does
    int8_x: Int8XForm | None = None  # the decode matmuls read int8 codes of x (MatmulSpec.int8_x), made where it says
    matrix_matmuls: bool = False  # the prefill matmuls' subgroup-matrix builds (MatmulSpec.matrix)
    short_tile: bool = False  # the prefill matmuls' short token tile
    window_attention: AttentionChoice | None = None  # the sliding-window layers' (a model with them)

    @property
    def prefill(self) -> bool:
        return self.n > 1

    @property
    def key(self) -> "PassPlan":
        """The plan with n and S reduced to what fixes the dispatches: one token or several, one split
        or several (their exact values are per-step values of the bound plan)."""
        a, w = self.attention, self.window_attention
        return replace(self, n=min(self.n, 2), attention=AttentionChoice(a.nest, a.layout, min(a.num_splits, 2)),
                       window_attention=w and AttentionChoice(w.nest, w.layout, min(w.num_splits, 2)))

    @property
    def merges_split(self) -> bool:
        """Whether the attention call's merge dispatch is left out (the o-projection or its quantizer merges)."""
        return self.o_merges or self.quantizer_merges

    @property
    def matmuls_label(self) -> str:
        """A prefill pass's matmul builds as the overlay names them ("" for one token)."""
        if not self.prefill:
            return ""
        tile = SHORT_PREFILL_TOKENS if self.short_tile else PREFILL_TOKEN_TILE
        return f"{'subgroup-matrix' if self.matrix_matmuls else 'scalar'} matmuls, {tile}-token tiles"

    @property
    def kernel_label(self) -> str:
        """The pass's kernels as its stats name them."""
        return f"{self.attention} · {self.matmuls_label}" if self.prefill else str(self.attention)

    @property
    def timing_note(self) -> str:
        return O_MERGE_NOTE if self.o_merges else QUANTIZER_MERGE_NOTE if self.quantizer_merges else ""
