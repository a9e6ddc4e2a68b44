//! One sequence's f32 KV cache, allocated once for the positions it may
//! hold (its reservation: prompt + new tokens within the context). The
//! buffers are zero-initialised allocations, so the OS commits pages only
//! as positions are written.

pub(crate) struct KvCache {
    kv_dim: usize,
    capacity: usize,
    /// Per layer, `[capacity, kv_dim]` each.
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl KvCache {
    pub fn new(num_layers: usize, capacity: usize, kv_dim: usize) -> Self {
        KvCache {
            kv_dim,
            capacity,
            keys: (0..num_layers)
                .map(|_| vec![0f32; capacity * kv_dim])
                .collect(),
            values: (0..num_layers)
                .map(|_| vec![0f32; capacity * kv_dim])
                .collect(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Stores `[n, kv_dim]` keys and values at positions `start..start + n`.
    pub fn write(&mut self, layer: usize, start: usize, k: &[f32], v: &[f32]) {
        let r = start * self.kv_dim..start * self.kv_dim + k.len();
        assert!(
            r.end <= self.capacity * self.kv_dim,
            "KV write past the context"
        );
        self.keys[layer][r.clone()].copy_from_slice(k);
        self.values[layer][r].copy_from_slice(v);
    }

    pub fn num_layers(&self) -> usize {
        self.keys.len()
    }

    /// Keys and values of positions `start..start + n`.
    pub fn rows(&self, layer: usize, start: usize, n: usize) -> (&[f32], &[f32]) {
        let r = start * self.kv_dim..(start + n) * self.kv_dim;
        (&self.keys[layer][r.clone()], &self.values[layer][r])
    }

    /// Keys and values of positions `0..len`.
    pub fn layer(&self, layer: usize, len: usize) -> (&[f32], &[f32]) {
        let n = len * self.kv_dim;
        (&self.keys[layer][..n], &self.values[layer][..n])
    }
}
