"""What the project adds to vLLM's workers (`worker_extension_cls`, set when an engine joins transfer groups),
called through `collective_rpc` by name."""

from __future__ import annotations


class TransferWorkerExtension:
    """Mixed into vLLM's worker class in each worker process."""

    def offpolicy_discard_partial_loads(self) -> int:
        """After a failed receive: drop what vLLM's layerwise reload buffered for the modules that had not
        received all their tensors, so the file generation loaded next fills each of them whole. Left in
        place, a module's buffered tensors count toward its total: it is processed as soon as the file
        load brings the rest of the count, with the failed version's tensors in it, and the file's
        remaining tensors for it are dropped as excess. Returns the modules reset."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        reset = 0
        for module in self.model_runner.get_model().modules():  # type: ignore[attr-defined]
            info = LAYERWISE_INFO.get(module)
            if info is not None and info.can_load() and (info.loaded_weights or info.load_numel):
                info.loaded_weights, info.load_numel = [], 0
                reset += 1
        return reset
