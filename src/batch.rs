//! A collated batch: one contiguous buffer with its shape, strides and labels.

use serde::{Deserialize, Serialize};

pub use crate::error::BadSampleKind;
use crate::pool::PooledBuffer;
use crate::transform::{DType, Layout};

/// A sample that could not be read or decoded, and what was done about it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BadSample {
    /// Dataset index.
    pub index: usize,
    /// Record key, or `#index` when the record could not be read.
    pub key: String,
    /// What kind of failure it was.
    pub kind: BadSampleKind,
    /// Why it failed: the full message, naming the file and what was wrong.
    pub reason: String,
    /// The dataset index that took its slot (`replace` policy), if any.
    pub replaced_by: Option<usize>,
    /// Under the `replace` policy, a sample tried as a replacement for this dataset index and
    /// found bad itself: reported, but not one of the epoch's own samples, so not counted
    /// against `max_bad` (which counts the same samples whatever the policy).
    pub while_replacing: Option<usize>,
}

/// One batch, delivered in order. Its memory returns to the loader's pool when dropped.
pub struct Batch {
    /// Epoch it belongs to.
    pub epoch: u64,
    /// Position in the epoch, `0..batches_per_epoch`.
    pub index: usize,
    /// Dataset index of each slot, in order.
    pub samples: Vec<usize>,
    /// Class label of each slot.
    pub labels: Vec<u32>,
    /// With MixUp/CutMix ([`LoaderConfig::batch_mix`]): each slot's class probabilities,
    /// `[n, num_classes]` row-major, the labels mixed as the images were; `None` otherwise.
    ///
    /// [`LoaderConfig::batch_mix`]: crate::loader::LoaderConfig::batch_mix
    pub soft_labels: Option<Vec<f32>>,
    /// Bad samples met while building this batch.
    pub bad: Vec<BadSample>,
    /// `[n, 3, h, w]` for NCHW, `[n, h, w, 3]` for NHWC.
    pub shape: [usize; 4],
    /// Element type.
    pub dtype: DType,
    /// Dimension order.
    pub layout: Layout,
    pub(crate) data: PooledBuffer,
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("epoch", &self.epoch)
            .field("index", &self.index)
            .field("shape", &self.shape)
            .field("dtype", &self.dtype)
            .field("layout", &self.layout)
            .field("bad", &self.bad)
            .finish()
    }
}

impl Batch {
    /// A batch made outside the loader (a custom source for the GPU feed, a benchmark):
    /// `data` holds the elements, C-contiguous, `shape` in `layout`'s order, one label and one
    /// sample index per sample.
    ///
    /// # Errors
    /// [`Error::Config`](crate::Error::Config) when `data`'s length is not the shape's
    /// element count times the element size, or the labels or samples do not match `shape[0]`.
    #[allow(clippy::too_many_arguments)]
    pub fn from_parts(
        epoch: u64,
        index: usize,
        samples: Vec<usize>,
        labels: Vec<u32>,
        shape: [usize; 4],
        dtype: DType,
        layout: Layout,
        data: PooledBuffer,
    ) -> crate::Result<Batch> {
        let bytes = shape.iter().product::<usize>() * dtype.size();
        if data.as_slice().len() != bytes || labels.len() != shape[0] || samples.len() != shape[0] {
            return Err(crate::Error::Config(format!(
                "a batch of shape {shape:?} {} needs {bytes} bytes and {} labels and samples, got {} bytes, {} labels, {} samples",
                dtype.name(),
                shape[0],
                data.as_slice().len(),
                labels.len(),
                samples.len()
            )));
        }
        Ok(Batch {
            epoch,
            index,
            samples,
            labels,
            soft_labels: None,
            bad: Vec::new(),
            shape,
            dtype,
            layout,
            data,
        })
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.shape[0]
    }

    /// True for a batch with no samples (every sample was bad under `skip`).
    pub fn is_empty(&self) -> bool {
        self.shape[0] == 0
    }

    /// Strides in elements, C-contiguous: the batch is always one dense block.
    pub fn strides(&self) -> [usize; 4] {
        let [_, a, b, c] = self.shape;
        [a * b * c, b * c, c, 1]
    }

    /// The raw bytes (native-endian elements).
    pub fn bytes(&self) -> &[u8] {
        self.data.as_slice()
    }

    /// The elements as `f32`.
    ///
    /// # Panics
    /// When the batch is not `f32`.
    pub fn as_f32(&self) -> &[f32] {
        self.elements(DType::F32)
    }

    /// The elements as IEEE binary16 bit patterns (`half::f16::from_bits` reads them).
    ///
    /// # Panics
    /// When the batch is not `f16`.
    pub fn as_f16_bits(&self) -> &[u16] {
        self.elements(DType::F16)
    }

    /// The bytes viewed as elements of `dtype`, which must be the batch's and `T`'s size.
    fn elements<T: Copy>(&self, dtype: DType) -> &[T] {
        assert_eq!(self.dtype, dtype, "batch holds {}", self.dtype.name());
        debug_assert_eq!(std::mem::size_of::<T>(), dtype.size());
        // SAFETY: `T` is f32 or u16 (plain numbers: any bit pattern is valid); pool buffers are
        // at least 16-byte aligned and hold whole elements, which the assert below confirms.
        let (head, elements, tail) = unsafe { self.bytes().align_to::<T>() };
        assert!(
            head.is_empty() && tail.is_empty(),
            "batch buffer is not aligned for {}",
            dtype.name()
        );
        elements
    }

    /// The batch's memory, taken out of the batch: it goes back to the loader's pool when the
    /// returned buffer is dropped. For a consumer that hands the memory on (a Python tensor
    /// viewing it); read `shape`, `labels` and the rest first.
    pub fn into_buffer(self) -> PooledBuffer {
        self.data
    }

    /// The elements as `u8`.
    ///
    /// # Panics
    /// When the batch is not `u8`.
    pub fn as_u8(&self) -> &[u8] {
        assert_eq!(self.dtype, DType::U8, "batch holds {}", self.dtype.name());
        self.bytes()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::pool::{BufferPool, HeapAllocator};

    #[test]
    fn a_batch_from_parts_must_hold_exactly_its_shape() {
        let pool = BufferPool::new(Arc::new(HeapAllocator));
        let make = |bytes: usize, labels: usize| {
            Batch::from_parts(
                0,
                3,
                (0..labels).collect(),
                vec![1; labels],
                [2, 4, 5, 3],
                DType::F32,
                Layout::Nhwc,
                pool.take(bytes),
            )
        };
        let batch = make(2 * 4 * 5 * 3 * 4, 2).unwrap();
        assert_eq!(
            (batch.len(), batch.index, batch.as_f32().len()),
            (2, 3, 120)
        );
        for (bytes, labels) in [(2 * 4 * 5 * 3, 2), (2 * 4 * 5 * 3 * 4 + 4, 2), (480, 3)] {
            let err = make(bytes, labels).unwrap_err();
            assert!(matches!(err, crate::Error::Config(_)), "{err}");
        }
    }
}
