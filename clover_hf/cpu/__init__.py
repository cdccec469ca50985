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
    available,
    build_id,
    cosine_gate,
    DecoderLayer,
    DecoderStack,
    KeyLayout,
    norm,
    prepare,
    rms_norm,
    rope,
    Screen,
    serves,
    silu_mul,
    SlotMover,
    top_k_columns,
    top_probs,
)
from .products import (  # noqa: F401
    COPIES,
    form_for,
    linear,
    LinearForms,
    PACK_ROWS,
)
from .linears import (  # noqa: F401
    copy_form,
    evident_forms,
    faster_forms,
    make_copy,
    ONE_ROW_GAIN,
    WeightCopies,
)
from .binding import (  # noqa: F401
    BlockMemo,
    BoundLinear,
    kernel_weights,
    layer_weights,
    linear_forms,
)
from .form_trials import (  # noqa: F401
    FormTrials,
    row_bucket,
)
