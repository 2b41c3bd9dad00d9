"""The training loss: next-token cross-entropy plus KL distillation from the dense teacher, computed from the
final hidden states and the output embeddings chunk by chunk, so that neither model's full-vocabulary logits
are ever materialized.

    loss = ce_weight * CE(student) + kl_weight * T^2 * KL(softmax(teacher / T) || softmax(student / T))

CE is the mean over positions with a label (label -100 is ignored); KL is the mean over all positions.
Per chunk of tokens the forward computes the student's and the teacher's logits [chunk, V], the two losses and
their gradients with respect to the student's hidden states and output embeddings (the technique of
Liger-Kernel's fused linear cross-entropy, here in plain PyTorch on any device); backward only scales them.
Peak extra memory is a few [chunk, V] float32 tensors instead of [tokens, V] for each model.
`reference_loss` is the same loss written plainly; the tests pin one to the other.
"""

import torch
import torch.nn.functional as F

IGNORE = -100


def _chunk_terms(s_logits, t_logits, labels, temperature: float, ce_scale, kl_scale: float):
    """Loss sums and d(loss)/d(logits) for one chunk. s_logits, t_logits: [c, V] float32; labels: [c].

    d(CE)/d(logits) = softmax(s) - onehot(label); d(T^2 KL)/d(logits) = T (softmax(s / T) - softmax(t / T)). At T = 1
    both use softmax(s), so the gradient is built in place from one softmax: few passes over the [c, V] tensors."""
    valid = (labels != IGNORE)[:, None].to(s_logits.dtype)  # [c, 1]
    target = labels.clamp_min(0)[:, None]
    log_p = F.log_softmax(s_logits, dim=-1)  # [c, V]
    ce = -(log_p.gather(1, target) * valid).sum()
    kl = s_logits.new_zeros(())
    row_scale = valid * ce_scale  # [c, 1]
    if t_logits is None:
        grad = log_p.exp_().mul_(row_scale)  # softmax, in place: log_p is not needed any more
    else:
        kl_coef = kl_scale * temperature
        log_p_t = F.log_softmax(t_logits / temperature if temperature != 1 else t_logits, dim=-1)
        log_q = log_p if temperature == 1 else F.log_softmax(s_logits / temperature, dim=-1)
        p_t = log_p_t.exp()
        kl = (p_t * (log_p_t - log_q)).sum() * temperature**2
        if temperature == 1:
            grad = log_p.exp_().mul_(row_scale + kl_coef)
        else:
            grad = log_p.exp_().mul_(row_scale).add_(log_q.exp_(), alpha=kl_coef)
        grad.sub_(p_t.mul_(kl_coef))
    grad.scatter_add_(1, target, -row_scale)
    return ce, kl, grad


class _FusedDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, t_hidden, t_weight, labels, temperature, ce_weight, kl_weight, chunk):
        # hidden: [N, H]; weight: [V, H]; t_hidden: [N, H] or None; labels: [N]
        n = hidden.shape[0]
        n_valid = (labels != IGNORE).sum().clamp_min(1).float()  # a tensor: no host sync
        ce_scale = ce_weight / n_valid
        kl_scale = kl_weight / n
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        ce_sum = hidden.new_zeros((), dtype=torch.float32)
        kl_sum = hidden.new_zeros((), dtype=torch.float32)
        for i in range(0, n, chunk):
            h = hidden[i : i + chunk]
            s_logits = (h @ weight.T).float()  # [c, V]
            t_logits = (t_hidden[i : i + chunk] @ t_weight.T).float() if t_hidden is not None else None
            ce, kl, grad = _chunk_terms(s_logits, t_logits, labels[i : i + chunk], temperature, ce_scale, kl_scale)
            ce_sum += ce
            kl_sum += kl
            grad = grad.to(hidden.dtype)
            grad_hidden[i : i + chunk] = grad @ weight
            if grad_weight is not None:
                grad_weight += (grad.T @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else torch.empty(0))
        ctx.has_weight_grad = grad_weight is not None
        ce_mean = ce_sum / n_valid
        kl_mean = kl_sum / n
        loss = ce_weight * ce_mean + (kl_weight * kl_mean if t_hidden is not None else 0.0)
        ctx.mark_non_differentiable(ce_mean, kl_mean)
        return loss, ce_mean, kl_mean

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_kl):
        grad_hidden, grad_weight = ctx.saved_tensors
        gw = grad_weight * grad_loss.to(grad_weight.dtype) if ctx.has_weight_grad else None
        return grad_hidden * grad_loss.to(grad_hidden.dtype), gw, None, None, None, None, None, None, None


def distill_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, t_hidden: torch.Tensor | None = None,
                 t_weight: torch.Tensor | None = None, temperature: float = 1.0, ce_weight: float = 1.0,
                 kl_weight: float = 0.0, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, mean CE, mean KL) from final hidden states, without [N, V] logits.

    hidden: [N, H] student's final (normed) hidden states; weight: [V, H] its output embeddings;
    labels: [N] next-token ids (-100: no label); t_hidden: [N, H] and t_weight: [V, H] the teacher's (no KL when
    None). CE and KL come back detached, for logging.
    """
    if t_hidden is None or kl_weight == 0:
        t_hidden, t_weight = None, None  # the teacher's logits are computed in the teacher's own dtype
    loss, ce, kl = _FusedDistill.apply(hidden, weight, t_hidden, t_weight, labels, float(temperature),
                                       float(ce_weight), float(kl_weight), int(chunk))
    return loss, ce, kl


def reference_loss(hidden, weight, labels, t_hidden=None, t_weight=None, temperature=1.0, ce_weight=1.0, kl_weight=0.0):
    """The same loss computed plainly through full [N, V] logits (the specification the fused version is tested against)."""
    logits = (hidden @ weight.T).float()
    ce = F.cross_entropy(logits, labels, ignore_index=IGNORE)
    loss = ce_weight * ce
    kl = logits.new_zeros(())
    if t_hidden is not None and kl_weight:
        t_logits = (t_hidden @ t_weight.T).float()
        log_q = F.log_softmax(logits / temperature, dim=-1)
        log_p = F.log_softmax(t_logits / temperature, dim=-1)
        kl = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean") * temperature**2
        loss = loss + kl_weight * kl
    return loss, ce.detach(), kl.detach()


@torch.no_grad()
def ce_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed next-token CE, number of labelled positions) without [N, V] logits. hidden: [N, H]; labels: [N]."""
    total = hidden.new_zeros((), dtype=torch.float32)
    for i in range(0, hidden.shape[0], chunk):
        logits = (hidden[i : i + chunk] @ weight.T).float()
        total += F.cross_entropy(logits, labels[i : i + chunk], ignore_index=IGNORE, reduction="sum")
    return total, (labels != IGNORE).sum()
