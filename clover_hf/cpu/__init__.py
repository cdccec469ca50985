"""The CPU backend: a compiled kernel for bf16 Llama-pattern bases on x86 (products, norms, attention, the
heads' primitives), the forms linear layers multiply in, and how a call learns them. Entered only through this
package: everything the rest of clover_hf uses is named here."""

from .dtype import (  # noqa: F401
    default_dtype,
)
from .kernel import (  # noqa: F401
    add_rms_norm,
    argmax,
    attention,
    attention_decoder,
    available,
    build_id,
    cosine_gate,
    DecoderLayer,
    DecoderStack,
    Features,
    int8_product,
    KeyLayout,
    norm,
    output_head,
    prepare,
    rms_norm,
    rope,
    Screen,
    serves,
    silu_mul,
    SlotMover,
    StaticDraft,
    top_k_columns,
    top_probs,
)
from .linears import (  # noqa: F401
    BlockMemo,
    COPIES,
    copy_form,
    evident_forms,
    faster_forms,
    form_for,
    kernel_weights,
    layer_weights,
    linear,
    linear_forms,
    LinearForms,
    make_copy,
    ONE_ROW_GAIN,
    PACK_ROWS,
    WeightCopies,
)
from .form_trials import (  # noqa: F401
    FormTrials,
    row_bucket,
)
