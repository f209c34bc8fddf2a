"""A full-attention attn-core backend in one file: torch SDPA over the core's paged KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attn_core.backend import Backend, BackendCapabilities
from attn_core.hookspecs import hookimpl
from attn_core.state.kv_write import write_kv_slots

ATTN_CORE_API_VERSION = "1.1"
CAPS = BackendCapabilities(
    kinds={"full"},
    device_types={"cpu", "cuda"},
    dtypes={"float32", "bfloat16"},
    head_dims={64, 128},
    page_sizes={16},
    mixed_kv_dtypes=False,  # SDPA takes q, k and v in one dtype: the cache in the layer's
)


@hookimpl
def attn_core_register_backends(register):
    register(Backend(name="sdpa", capabilities=CAPS, description="torch SDPA, paged KV"))


@hookimpl
def attn_core_allocate_context(backend, group, device, constraints, state, workspace):
    return SDPAContext()


class SDPAContext:
    def prepare(self, batch):  # nothing to plan: keep the batch (its tensors are the core's)
        self.batch = batch

    update = prepare

    def forward(self, layer, q, k, v, out, **inputs):
        b, kv, t = self.batch, layer.kv, self.batch.num_tokens
        if out is None:
            out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
        # the new tokens go into the paged cache first; the core's writer skips padding (-1)
        write_kv_slots(k[:t], v[:t], kv.k, kv.v, b.slot_mapping)
        qsl, seq, page = b.query_start_loc_cpu, b.seq_lens_cpu, kv.k.shape[1]
        for i in range(b.num_reqs):  # one SDPA call per request over its pages
            a, e, s = int(qsl[i]), int(qsl[i + 1]), int(seq[i])
            pages = b.page_table[i, : -(-s // page)].long()
            rep = q.shape[1] // kv.k.shape[2]
            keys = kv.k[pages].flatten(0, 1)[:s].transpose(0, 1).repeat_interleave(rep, 0)
            vals = kv.v[pages].flatten(0, 1)[:s].transpose(0, 1).repeat_interleave(rep, 0)
            mask = torch.ones(e - a, s, dtype=torch.bool, device=q.device).tril(s - (e - a))
            o = F.scaled_dot_product_attention(
                q[a:e].transpose(0, 1), keys, vals, attn_mask=mask, scale=layer.scale
            )
            out[a:e] = o.transpose(0, 1)
        return out
