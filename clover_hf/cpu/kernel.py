"""The compiled bf16 kernel for x86 CPUs with AVX2 or AVX-512-BF16 (`kernels/`), its Python side in one namespace
for the cpu package's own modules (the rest of clover_hf reaches it through `clover_hf.cpu`):

- `kernel_library`: the build and loading (`KernelLibrary`, the process's one `KERNEL`) and the C functions' bindings;
- `kernel_products`: products of a few bf16 rows by tiled bf16 weights;
- `kernel_selection`: greedy acceptance's argmax, the heads' softmax top-k, a top-k warper's cut, and an lm_head's
  argmax and top-k without computing all its logits (`Screen`);
- `kernel_layers`: transformers' RMSNorm (alone or with the residual sum before it), rotary embedding, Clover's cosine
  gate and SwiGLU's activation in one call each, the attention of a few query tokens, a KV cache's keys laid out and
  its compaction, and all of these as whole decoder layers in one call (`DecoderLayer`, `DecoderStack`);
"""

from .kernel_layers import (  # noqa: F401
    add_rms_norm,
    attention,
    cosine_gate,
    DecoderLayer,
    DecoderStack,
    KeyLayout,
    norm,
    rms_norm,
    rope,
    silu_mul,
    SlotMover,
)
from .kernel_library import (  # noqa: F401
    available,
    build_id,
    cpu_supports,
    instruction_set,
    KERNEL,
    prepare,
    serves,
)
from .kernel_products import (  # noqa: F401
    fits,
    linear,
    product,
    tile,
    TILE,
)
from .kernel_selection import (  # noqa: F401
    argmax,
    Screen,
    top_k_columns,
    top_probs,
    TOP_MOST,
)
