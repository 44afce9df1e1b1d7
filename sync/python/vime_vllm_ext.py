"""vLLM worker extension: vime's torch-free Rust trainer pushes weights into a running vLLM server.

Load: ``vllm serve ... --worker-extension-cls vime_vllm_ext.VimeWorkerExtension`` (module on
PYTHONPATH, ``VLLM_SERVER_DEV_MODE=1``; no ``--weight-transfer-config``, no pickles). vLLM appends
this class to the GPU Worker's bases (v1/worker/worker_base.py:261-286), so ``self`` is the Worker.
Each method is driven by ``POST /collective_rpc {"method": NAME, "args": [ONE_JSON_STRING],
"kwargs": {}}``, takes one JSON object text and returns a small dict (one per worker in ``results``).

- ``vime_init_weight_transfer``: ``{"backend": "ipc", "device_uuid": "<32 hex>"}`` (must be this
  worker's GPU; drops cached IPC mappings) or ``{"backend": "nccl", "nccl_unique_id_b64": <b64 of
  128 bytes>, "rank_offset": int, "world_size": int}`` (rank = rank_offset + dp_index*TP*PP +
  parallel_config.rank; the trainer is rank 0 and enters ncclCommInitRank concurrently, then both
  sides run a 1-element fp32 SUM all-reduce warm-up).
- ``vime_start_weight_update``: ``{}`` -> ``initialize_layerwise_reload(model)``.
- ``vime_update_weights``: ``{"names", "dtype_names", "shapes", "packed": true, "nbytes",
  "ipc_handle_b64" (IPC only)}``. A bucket holds the tensors back to back in list order (safetensors
  layout, no padding). IPC: the sender buffer's 64-byte cudaIpcMemHandle, opened once, cached by its
  b64 text. NCCL: one uint8 ncclBroadcast of nbytes from root 0. Tensors are copied out (the sender
  reuses its buffer after the call) and passed to ``model.load_weights``.
- ``vime_finish_weight_update``: ``{"weight_version": "<n>"}`` -> ``finalize_layerwise_reload``;
  keeps and returns ``{"weight_version": v}``. ``vime_weight_info``: ``{}`` -> the same dict (null
  before the first finish).

Session rules are vLLM's (gpu_worker.py:1313-1376): start twice, or update/finish without start,
is an error; a failed update ends the session (layers may be partial: start again, resend all).
Send every weight of any layer you touch (layerwise reload).

Targets vLLM 0.24-0.26, checked against the 0.24.0 and 0.26.0 wheels (line numbers: 0.26.0).
0.33.0 keeps every API used here (same rank formula, nccl_common.py:239-244) and also accepts
``nccl_unique_id_b64`` natively, so on 0.33 only the IPC path needs this extension.
Run: the IPC path inside a real vLLM 0.26.0 on an H200 on 2026-12-01 (scripts/gpu/vllm_sync.sh,
Qwen3-0.6B and 4B shapes, and scripts/gpu/vllm_grpo.sh): the uuid check, the 64-byte handle in
vLLM's 128-byte struct, the zero-copy wrap and the load all worked (vLLM's log-probs after the sync
equal vime's within bf16 error; benches/results/2026-12-01-vllm-sync-h200.md). The NCCL path has
NOT been run (it needs two GPUs). "NOT VERIFIED" marks what no source read confirmed; the IPC ones
are now confirmed by those runs.
"""

import base64
import ctypes
import json
import threading

import torch

_NCCL_KEYS = {"backend", "nccl_unique_id_b64", "rank_offset", "world_size"}
_IPC_KEYS = {"backend", "device_uuid"}
_UPDATE_KEYS = {"names", "dtype_names", "shapes", "packed", "nbytes", "ipc_handle_b64"}
_IPC_HANDLE_BYTES = 64  # CUDA_IPC_HANDLE_SIZE; cudaIpcMemHandle_t and CUipcMemHandle are the same bytes


def _parse(method, arg, allowed, required=()):
    d = json.loads(arg) if isinstance(arg, (str, bytes)) else arg
    if not isinstance(d, dict):
        raise ValueError(f"{method}: the argument must be a JSON object, got {type(d).__name__}")
    for k in [k for k in d if k not in allowed]:
        raise ValueError(f"{method}: unknown key {k!r} (allowed: {sorted(allowed)})")
    for k in [k for k in required if k not in d]:
        raise ValueError(f"{method}: missing key {k!r}")
    return d


def _norm_uuid(u):
    s = str(u).strip().lower()
    return (s[4:] if s.startswith("gpu-") else s).replace("-", "")


def _device_uuid_hex(device):
    uuid = torch.cuda.get_device_properties(device).uuid
    # NOT VERIFIED in torch's source (from memory): _CUuuid has .bytes (16 ints) and str() "8-4-4-4-12"
    # hex; vLLM keys on str(props.uuid) (ipc_engine.py:259-260). Try the bytes, then the string.
    try:
        return bytes(bytearray(int(b) & 0xFF for b in uuid.bytes)).hex()
    except (AttributeError, TypeError, ValueError):
        return _norm_uuid(uuid)


class _CudaArray:
    """A device pointer as a 1-D uint8 ``__cuda_array_interface__`` (v3, no stream: the sender
    synchronised before sending the handle)."""

    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}


class VimeWorkerExtension:
    # State lives on the Worker under _vime_* names; worker_base.py:268-275 asserts that no class
    # attribute here clashes with a Worker attribute.
    _vime_backend = _vime_nccl = _vime_comm = _vime_cudart = _vime_ipc_ptrs = None
    _vime_model = None  # the model of the active session (None: no session)
    _vime_weight_version = None

    def vime_init_weight_transfer(self, arg):
        m = "vime_init_weight_transfer"
        backend = _parse(m, arg, _IPC_KEYS | _NCCL_KEYS).get("backend")
        if backend == "ipc":
            d = _parse(m, arg, _IPC_KEYS, _IPC_KEYS)
            want, mine = _norm_uuid(d["device_uuid"]), _device_uuid_hex(self.device)
            if want != mine:
                raise ValueError(f"{m}: key 'device_uuid' {d['device_uuid']!r} is not this worker's GPU "
                                 f"({self.device}, uuid {mine}); CUDA IPC needs the same GPU")
            self._vime_reset()
            from vllm.distributed.device_communicators.cuda_wrapper import CudaRTLibrary
            self._vime_cudart, self._vime_backend = CudaRTLibrary(), "ipc"  # cuda_wrapper.py:105
            return {"backend": "ipc", "device_uuid": mine}
        if backend != "nccl":
            raise ValueError(f"{m}: key 'backend' must be 'ipc' or 'nccl', got {backend!r}")
        d = _parse(m, arg, _NCCL_KEYS, _NCCL_KEYS)
        from vllm.distributed.device_communicators.pynccl_wrapper import (
            NCCLLibrary, buffer_type, cudaStream_t, ncclDataTypeEnum, ncclRedOpTypeEnum)
        uid = base64.b64decode(d["nccl_unique_id_b64"], validate=True)
        if len(uid) != 128:
            raise ValueError(f"{m}: key 'nccl_unique_id_b64' decodes to {len(uid)} bytes, not 128")
        world_size, offset = int(d["world_size"]), int(d["rank_offset"])
        pc = self.parallel_config  # rank as nccl_common.py:66-73 (0.24: nccl_engine.py:148-154)
        rank = offset + int(getattr(pc, "data_parallel_index", 0) or 0) * pc.world_size + pc.rank
        if not 0 < rank < world_size:
            raise ValueError(f"{m}: rank {rank} (key 'rank_offset' {offset}) is out of range for key "
                             f"'world_size' {world_size}; rank 0 is the trainer")
        self._vime_reset()
        nccl = NCCLLibrary()  # pynccl_wrapper.py:147
        with torch.cuda.device(self.device):
            comm = nccl.ncclCommInitRank(world_size, nccl.unique_id_from_bytes(uid), rank)  # :418, :409
            # Warm-up as PyNcclCommunicator.__init__ (pynccl.py:136-146); the trainer does the same.
            data = torch.zeros(1, dtype=torch.float32, device=self.device)
            out = torch.empty_like(data)
            nccl.ncclAllReduce(buffer_type(data.data_ptr()), buffer_type(out.data_ptr()), 1,  # :429
                               ncclDataTypeEnum.from_torch(torch.float32), ncclRedOpTypeEnum.ncclSum,
                               comm, cudaStream_t(torch.cuda.current_stream().cuda_stream))
            torch.cuda.synchronize(self.device)
        self._vime_nccl, self._vime_comm, self._vime_backend = nccl, comm, "nccl"
        return {"backend": "nccl", "rank": rank, "world_size": world_size}

    def vime_start_weight_update(self, arg):
        _parse("vime_start_weight_update", arg, ())
        if self._vime_model is not None:
            raise RuntimeError("vime_start_weight_update: an update is already active (finish it first)")
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        model = self.model_runner.get_model()  # gpu_model_runner.py:3288 (unwraps CUDA graphs)
        # As the 0.26 engines (nccl_engine.py:137-143, ipc_engine.py:209-215); 0.24's Worker wraps
        # it in torch.device(self.device) (0.24 gpu_worker.py:1068), harmless in 0.26.
        with torch.device(self.device):
            initialize_layerwise_reload(model)  # layerwise.py:84
        self._vime_model = model
        return {"started": True}

    def vime_update_weights(self, arg):
        m = "vime_update_weights"
        d = _parse(m, arg, _UPDATE_KEYS, ("names", "dtype_names", "shapes", "nbytes"))
        model = self._vime_model
        if model is None:
            raise RuntimeError(f"{m}: call vime_start_weight_update first")
        try:
            weights = self._vime_receive(d)
            if weights:
                try:
                    with torch.no_grad(), torch.device(self.device):
                        model.load_weights(weights)  # positional, as ipc_engine.py:277, nccl_engine.py:199
                except Exception as e:
                    raise RuntimeError(f"{m}: load_weights failed for the bucket of {len(weights)} tensors "
                                       f"{weights[0][0]!r} .. {weights[-1][0]!r}: {e}") from e
            torch.cuda.synchronize(self.device)
        except BaseException:
            self._vime_model = None  # as vLLM, a failed update ends the session (gpu_worker.py:1358-1363)
            raise
        return {"tensors": len(weights), "nbytes": int(d["nbytes"])}

    def vime_finish_weight_update(self, arg):
        d = _parse("vime_finish_weight_update", arg, ("weight_version",))
        model = self._vime_model
        if model is None:
            raise RuntimeError("vime_finish_weight_update: no update is active (call vime_start_weight_update)")
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        self._vime_model = None
        with torch.device(self.device):
            finalize_layerwise_reload(model, self.model_config)  # layerwise.py:289, nccl_engine.py:151
        torch.cuda.synchronize(self.device)
        v = d.get("weight_version")
        self._vime_weight_version = None if v is None else str(v)
        return {"weight_version": self._vime_weight_version}

    def vime_weight_info(self, arg):
        _parse("vime_weight_info", arg, ())
        return {"weight_version": self._vime_weight_version}

    # ---- helpers ----
    def _vime_receive(self, d):
        """The bucket's tensors as [(name, tensor)], none aliasing the sender's memory."""
        m = "vime_update_weights"
        if d.get("packed", True) is not True:
            raise ValueError(f"{m}: key 'packed' must be true (only packed buckets are supported)")
        names, dtype_names, shapes, nbytes = d["names"], d["dtype_names"], d["shapes"], int(d["nbytes"])
        if not len(names) == len(dtype_names) == len(shapes):
            raise ValueError(f"{m}: keys 'names', 'dtype_names', 'shapes' differ in length "
                             f"({len(names)}, {len(dtype_names)}, {len(shapes)})")
        specs, off = [], 0
        for name, dn, shape in zip(names, dtype_names, shapes):
            dtype = getattr(torch, str(dn), None)  # as nccl_engine.py:177 (getattr(torch, dtype_name))
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{m}: tensor {name!r}: unknown dtype {dn!r}")
            if not isinstance(shape, list) or any(not isinstance(s, int) or s < 0 for s in shape):
                raise ValueError(f"{m}: tensor {name!r}: bad shape {shape!r}")
            numel, esize = 1, torch.empty((), dtype=dtype).element_size()
            for s in shape:
                numel *= s
            specs.append((name, dtype, shape, off, numel * esize, esize))
            off += numel * esize
        if off != nbytes:
            raise ValueError(f"{m}: key 'nbytes' is {nbytes} but tensors {names[:1]}..{names[-1:]} "
                             f"take {off} bytes")
        if not specs:
            return []
        if self._vime_backend is None:
            raise RuntimeError(f"{m}: call vime_init_weight_transfer first")
        if ("ipc_handle_b64" in d) != (self._vime_backend == "ipc"):
            raise ValueError(f"{m}: key 'ipc_handle_b64' is required for, and only for, the ipc backend "
                             f"(this one is {self._vime_backend})")
        if self._vime_backend == "ipc":
            buf, copy = self._vime_ipc_buffer(d["ipc_handle_b64"], nbytes), True  # the sender reuses it
        else:  # nccl: a fresh buffer, so views of it are safe
            from vllm.distributed.device_communicators.pynccl_wrapper import (
                buffer_type, cudaStream_t, ncclDataTypeEnum)
            buf, copy = torch.empty(nbytes, dtype=torch.uint8, device=self.device), False
            # A non-root rank passes a null sendbuff (pynccl.py:385-391); current stream as
            # nccl_engine.py:196-198; ncclBroadcast at pynccl_wrapper.py:538.
            self._vime_nccl.ncclBroadcast(buffer_type(), buffer_type(buf.data_ptr()), nbytes,
                                          ncclDataTypeEnum.ncclUint8, 0, self._vime_comm,
                                          cudaStream_t(torch.cuda.current_stream().cuda_stream))
        out = []
        for name, dtype, shape, off, size, esize in specs:
            b = buf[off:off + size]
            # view(dtype) needs a byte offset aligned to the element size; the layout has no padding,
            # so with mixed dtypes a slice may be unaligned: copy it first.
            if copy or off % esize:
                b = b.clone()
            try:
                out.append((name, b.view(dtype).view(shape)))
            except RuntimeError as e:
                raise ValueError(f"{m}: tensor {name!r}: cannot view as {dtype} {shape}: {e}") from e
        return out

    def _vime_ipc_buffer(self, handle_b64, nbytes):
        if self._vime_ipc_ptrs is None:
            self._vime_ipc_ptrs = {}
        ptr = self._vime_ipc_ptrs.get(handle_b64)
        if ptr is None:
            raw = base64.b64decode(handle_b64, validate=True)
            if len(raw) != _IPC_HANDLE_BYTES:
                raise ValueError(f"vime_update_weights: key 'ipc_handle_b64' decodes to {len(raw)} bytes, "
                                 f"not {_IPC_HANDLE_BYTES}")
            from vllm.distributed.device_communicators.cuda_wrapper import cudaIpcMemHandle_t
            # NOT VERIFIED (ABI reasoning, not run): vLLM's struct is 128 bytes (cuda_wrapper.py:30-31),
            # CUDA's is 64. It is passed by value on the stack (x86-64 SysV MEMORY class, the only stack
            # argument), so the callee reads the first 64 bytes and ignores the zero tail. vLLM's own
            # IPC test passes the same struct (all_reduce_utils.py:199).
            h = cudaIpcMemHandle_t()
            ctypes.memmove(ctypes.addressof(h.internal), raw, _IPC_HANDLE_BYTES)
            with torch.cuda.device(self.device):
                p = self._vime_cudart.cudaIpcOpenMemHandle(h)  # cuda_wrapper.py:179, lazy peer access
            if not p.value:
                raise RuntimeError("vime_update_weights: cudaIpcOpenMemHandle returned a null pointer")
            ptr = self._vime_ipc_ptrs[handle_b64] = p.value
        # NOT VERIFIED against torch's source: torch.as_tensor wraps __cuda_array_interface__ without
        # a copy and keeps the wrapper alive. Fallback if not: torch.cuda.synchronize(), then
        # CudaRTLibrary.cudaMemcpy (cuda_wrapper.py:165) into torch.empty(nbytes, dtype=torch.uint8).
        return torch.as_tensor(_CudaArray(ptr, nbytes), device=self.device)

    def _vime_reset(self):
        """Forget the previous init: close the IPC mappings, abort the NCCL communicator."""
        ptrs, self._vime_ipc_ptrs, self._vime_backend = self._vime_ipc_ptrs, {}, None
        torch.cuda.synchronize(self.device)
        # CudaRTLibrary does not wrap cudaIpcCloseMemHandle: call it in the loaded libcudart (its
        # .lib, cuda_wrapper.py:120), best effort, ignoring the return code.
        close = getattr(getattr(self._vime_cudart, "lib", None), "cudaIpcCloseMemHandle", None)
        if ptrs and close is not None:
            with torch.cuda.device(self.device):
                for p in ptrs.values():
                    close(ctypes.c_void_p(p))
        nccl, comm = self._vime_nccl, self._vime_comm
        self._vime_nccl = self._vime_comm = None
        if nccl is not None and comm is not None:
            # As PyNcclCommunicator.destroy (pynccl.py:148-164): abort in a daemon thread, 5 s timeout.
            t = threading.Thread(target=lambda: nccl.ncclCommAbort(comm), daemon=True)  # pynccl_wrapper.py:557
            t.start()
            t.join(timeout=5.0)
