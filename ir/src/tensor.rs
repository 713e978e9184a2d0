//! A dense f32 tensor: the value type of the reference interpreter and of CPU activations.

#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl Tensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "tensor data does not match shape {shape:?}"
        );
        Self { shape, data }
    }

    pub fn zeros(shape: Vec<usize>) -> Self {
        let n = shape.iter().product();
        Self::new(shape, vec![0.0; n])
    }

    /// Size of the last dim (the row length of a row-major matrix).
    pub fn row_len(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Number of rows when viewed as `[rows, row_len]`.
    pub fn rows(&self) -> usize {
        self.data.len() / self.row_len().max(1)
    }

    pub fn row(&self, i: usize) -> &[f32] {
        let n = self.row_len();
        &self.data[i * n..(i + 1) * n]
    }
}
