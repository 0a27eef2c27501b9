"""Data: HDF5 datasets read per rank with parallel HDF5, a seeded distributed sampler, importers.

See docs/ARCHITECTURE.md (data).
"""
from mpidist.data.datasets import ArrayDataset, H5Dataset, H5TextDataset, open_dataset
from mpidist.data.importers import import_digits, import_text, make_synthetic, split_indices, synthetic_arrays
from mpidist.data.loader import build_datasets, iterate
from mpidist.data.sampler import DistributedSampler, epoch_order

__all__ = ["ArrayDataset", "H5Dataset", "H5TextDataset", "open_dataset", "import_digits", "import_text",
           "make_synthetic", "split_indices", "synthetic_arrays", "DistributedSampler", "epoch_order",
           "build_datasets", "iterate"]
