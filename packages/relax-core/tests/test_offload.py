"""HostOffload: storages freed in place and refilled, every reference to the tensors still valid."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from relax_core.offload import HostOffload, onloaded  # noqa: E402


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 16))
    model[2].weight = model[0].weight  # tied, as an LM's embedding and output layer
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 16, (4, 5), generator=g)
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()


def _tensors(model, opt):
    moments = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return [*model.parameters(), *moments]


def test_offload_frees_every_storage_and_onload_restores_the_next_step_bit_for_bit():
    model, opt = _model_and_optimizer()
    twin, twin_opt = _model_and_optimizer()
    for m, o in ((model, opt), (twin, twin_opt)):
        _step(m, o, 1)
    host = HostOffload("trainer")
    freed = host.offload(_tensors(model, opt))
    assert host.offloaded
    # every parameter and both AdamW moments per parameter: nothing left on the "device"
    assert all(t.untyped_storage().nbytes() == 0 for t in _tensors(model, opt))
    # the tied weight is one storage, counted once
    expected = sum(t.untyped_storage().nbytes() for t in _tensors(twin, twin_opt) if t.dim() > 0)
    assert expected <= freed <= expected + 64 * len(opt.state)  # (+ the scalar step counters)
    assert host.onload() == freed and not host.offloaded
    assert model[2].weight is model[0].weight
    for a, b in zip(_tensors(model, opt), _tensors(twin, twin_opt)):
        assert torch.equal(a, b)
    _step(model, opt, 2)  # the optimizer's references to its parameters and moments still hold
    _step(twin, twin_opt, 2)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_offload_without_keeping_frees_and_regrows_the_storage_for_new_contents():
    w = torch.nn.Parameter(torch.ones(32))
    host = HostOffload("engine")
    assert host.offload([w], keep=False) == 32 * 4
    assert w.untyped_storage().nbytes() == 0
    host.onload()
    assert w.untyped_storage().nbytes() == 32 * 4
    with torch.no_grad():
        w.copy_(torch.full((32,), 2.0))  # what the next weight update does
    assert torch.equal(w, torch.full((32,), 2.0))


def test_a_parameter_mapped_from_memory_it_does_not_own_gets_its_own_storage_once():
    # torch.from_numpy (like a checkpoint mapped from disk) gives a storage that cannot be resized
    w = torch.nn.Parameter(torch.from_numpy(np.arange(8, dtype=np.float32)))
    assert not w.untyped_storage().resizable()
    host = HostOffload()
    host.offload([w])
    assert w.untyped_storage().nbytes() == 0
    host.onload()
    assert torch.equal(w, torch.arange(8, dtype=torch.float32)) and w.untyped_storage().resizable()


def test_an_optimizer_state_restored_by_torch_load_offloads(tmp_path):
    # --load then --offload: the optimizer's restored states live in storages torch.load made, which
    # cannot be resized; offload refused them ("cannot be freed") and the resumed colocate run stopped
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.Adam([w])
    w.grad = torch.ones(4)
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    opt = torch.optim.Adam([w])
    opt.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=False))
    state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    before = [v.clone() for v in state]
    host = HostOffload("trainer")
    assert host.offload([w, *state]) > 0
    host.onload()
    assert all(torch.equal(a, b) for a, b in zip(state, before))


def test_offloading_twice_is_refused_and_onload_without_offload_is_a_no_op():
    w = torch.zeros(4)
    host = HostOffload("trainer")
    assert host.onload() == 0
    host.offload([w])
    with pytest.raises(RuntimeError, match="trainer is already offloaded; onload"):
        host.offload([w])


def test_onloaded_methods_take_the_tensors_back_first():
    class Role:
        def __init__(self):
            self.w = torch.arange(4.0)
            self._host = HostOffload()
            self.onloads = 0

        def onload(self):
            self.onloads += 1
            return self._host.onload()

        @onloaded
        def total(self):
            return float(self.w.sum())

    r = Role()
    r._host.offload([r.w])
    assert r.total() == 6.0 and r.onloads == 1
    assert r.total() == 6.0 and r.onloads == 1  # already there: no second onload


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_memory_goes_back_to_the_device_and_the_next_step_is_unchanged():
    """What colocate needs on a GPU: every byte the trainer held is free for the engine (allocated and in
    the caching allocator's reserve), pinned host copies bring it back exactly."""

    def model_and_optimizer():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Embedding(4096, 256), torch.nn.Linear(256, 256), torch.nn.Linear(256, 4096)
        ).cuda()
        model[2].weight = model[0].weight
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, opt, seed: int) -> None:
        x = torch.randint(0, 4096, (4, 5), generator=torch.Generator().manual_seed(seed)).cuda()
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad()

    (model, opt), (twin, twin_opt) = model_and_optimizer(), model_and_optimizer()
    for m, o in ((model, opt), (twin, twin_opt)):
        step(m, o, 1)
    tensors = _tensors(model, opt)
    on_gpu = sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.is_cuda}.values()
    )
    assert on_gpu >= 3 * 4 * (4096 * 256 + 256 * 256)  # weights (tied: once) and two moments, fp32
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    host = HostOffload("trainer")
    assert host.offload(tensors) >= on_gpu  # (+ AdamW's step counters, which live in host memory)
    offloaded = torch.cuda.memory_allocated()
    assert allocated - offloaded >= on_gpu
    assert reserved - torch.cuda.memory_reserved() >= on_gpu  # emptied from the cache, not only unused
    host.onload()
    assert torch.cuda.memory_allocated() - offloaded >= on_gpu  # (the allocator rounds blocks up)
    assert all(t.is_cuda for t in _tensors(model, opt) if t.dim()) and model[2].weight is model[0].weight
    step(model, opt, 2)
    step(twin, twin_opt, 2)
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # (index_add's atomics: not bit for bit)
