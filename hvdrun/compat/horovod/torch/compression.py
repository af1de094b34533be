"""``horovod.torch.compression``: :mod:`hvdrun.torch.compression`'s compressors."""

from hvdrun.torch.compression import Compression, Compressor, FP16Compressor, NoneCompressor

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
