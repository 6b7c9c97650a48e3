"""megatron-core's pure-torch optimizer fallbacks (no apex/TE), fixed on any device
(``dit_mcore/training/torch_optimizer.py``): a grad norm without host reads, and Adam state a
distributed-optimizer checkpoint can be read into."""
import torch

from dit_mcore.training import torch_optimizer
from dit_mcore.training.torch_optimizer import foreach_l2_norm, init_adam_state
from dit_mcore.training.trainer import Trainer
from test_training import _HostReads, tiny_run


def test_grad_norm_kernel_reads_nothing_to_the_host(tmp_path):
    """megatron's stand-in l2 kernel syncs the host per parameter; the foreach kernel put in its
    place returns the norm on the device and equals float64."""
    from megatron.core.optimizer import clip_grads
    trainer = Trainer(tiny_run(tmp_path))
    assert torch_optimizer.uses_torch_optimizer() and clip_grads.l2_norm_impl is foreach_l2_norm
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (3, 64, 1000)]
    with _HostReads() as reads:
        norm, _ = foreach_l2_norm(2048, None, [grads], False)
    assert reads.count == 0 and norm.shape == (1,)
    expected = torch.cat([g.double() for g in grads]).norm()
    torch.testing.assert_close(norm.double()[0], expected, rtol=1e-6, atol=0)
    trainer.train_step()
    with _HostReads() as reads:
        trainer.optimizer.get_grad_norm()
    assert reads.count == 1  # megatron's own final .item() of the norm


def test_init_adam_state_lets_a_fresh_distributed_optimizer_describe_its_state(tmp_path):
    trainer = Trainer(tiny_run(tmp_path, distopt=True))
    assert not trainer.optimizer.optimizer.state
    init_adam_state(trainer.optimizer)
    state = trainer.optimizer.optimizer.state
    assert state and all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in state.values())
    sharded = trainer.optimizer.sharded_state_dict(trainer.model.sharded_state_dict(), is_loading=True,
                                                   metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    assert sharded

