//! What the grouped expert GEMMs of every format (`ops::int4::grouped`,
//! `ops::int4::grouped_sm90`, `ops::mxfp4::grouped`) share on the host.
//!
//! Rows are grouped by expert beforehand (`moe_group` + `gather_rows`):
//! expert `e`'s rows are `offsets[e]..offsets[e + 1]`. The kernels cover
//! them in tiles of [`GROUPED_ROWS`] rows of one expert; the host passes the
//! tile count ([`grouped_tiles`] of the offsets it reads back) and each
//! block finds its expert on the device (`grouped_find_tile`, common.cuh).

use crate::Result;
use crate::launch::{check_len, dim_u32, ensure};

/// Rows of one expert a block of the grouped kernels covers (`GG_BT`,
/// `GW_BT` and `MXG_BT` in the kernels).
pub const GROUPED_ROWS: usize = 64;

/// The token tiles of a grouping whose per-expert row offsets are
/// `offsets` (`[E + 1]`, non-decreasing): `sum_e ceil(rows_e / 64)`.
pub fn grouped_tiles(offsets: &[u32]) -> usize {
    offsets
        .windows(2)
        .map(|w| (w[1].saturating_sub(w[0]) as usize).div_ceil(GROUPED_ROWS))
        .sum()
}

/// The checked dimensions of one grouped launch, as the kernels take them.
pub(crate) struct GroupedDims {
    pub n_experts: u32,
    pub n_table: u32,
    /// Token tiles: the grid's y.
    pub tiles: u32,
    /// Reduction width, intermediate width, output width.
    pub k: u32,
    pub i: u32,
    pub n: u32,
}

impl GroupedDims {
    /// Checks a launch of kernel `k` over `x` (`x_len` elements, `rows` x
    /// `kdim`) grouped by `offsets` (`offsets_len` entries for `n_experts`
    /// experts) into `tiles` tiles, with `table_len` pointer-table entries,
    /// intermediate width `inter` and output width `n_out`. `None`: no
    /// tiles, nothing to launch.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn check(
        k: &'static str,
        (x_len, rows, kdim): (usize, usize, usize),
        (offsets_len, n_experts, tiles): (usize, usize, usize),
        table_len: usize,
        inter: usize,
        n_out: usize,
    ) -> Result<Option<Self>> {
        check_len(k, "x", x_len, rows * kdim)?;
        check_len(k, "offsets", offsets_len, n_experts + 1)?;
        ensure(k, n_experts > 0, || "no experts".to_string())?;
        // Every row lies in some tile, each tile holds at most 64 rows and
        // at most one tile per expert is partial.
        ensure(
            k,
            tiles >= rows.div_ceil(GROUPED_ROWS) && tiles <= rows / GROUPED_ROWS + n_experts,
            || format!("{tiles} tiles cannot cover {rows} rows of {n_experts} experts"),
        )?;
        if tiles == 0 {
            return Ok(None);
        }
        let grid_y = dim_u32(k, "tiles", tiles)?;
        ensure(k, grid_y <= 65535, || {
            format!("{tiles} token tiles exceed 65535 per launch")
        })?;
        Ok(Some(GroupedDims {
            n_experts: dim_u32(k, "n_experts", n_experts)?,
            n_table: dim_u32(k, "n_table", table_len)?,
            tiles: grid_y,
            k: dim_u32(k, "K", kdim)?,
            i: dim_u32(k, "I", inter)?,
            n: dim_u32(k, "N", n_out)?,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_count_each_experts_rows_in_64s() {
        assert_eq!(grouped_tiles(&[0, 0, 0]), 0);
        assert_eq!(grouped_tiles(&[0, 1, 65, 65, 193]), 1 + 1 + 2);
        assert_eq!(grouped_tiles(&[0, 64, 128]), 2);
    }

    #[test]
    fn a_grouping_is_checked_before_any_launch() {
        let ok = GroupedDims::check("t", (128 * 8, 128, 8), (3, 2, 2), 2, 16, 8).unwrap();
        let d = ok.expect("tiles to launch");
        assert_eq!((d.n_experts, d.tiles, d.k, d.i, d.n), (2, 2, 8, 16, 8));
        assert!(
            GroupedDims::check("t", (0, 0, 8), (3, 2, 0), 2, 16, 8)
                .unwrap()
                .is_none()
        );
        // Too few tiles for the rows, too many, a short x, no experts.
        assert!(GroupedDims::check("t", (200 * 8, 200, 8), (3, 2, 3), 2, 16, 8).is_err());
        assert!(GroupedDims::check("t", (64 * 8, 64, 8), (3, 2, 4), 2, 16, 8).is_err());
        assert!(GroupedDims::check("t", (10, 64, 8), (3, 2, 1), 2, 16, 8).is_err());
        assert!(GroupedDims::check("t", (0, 0, 8), (1, 0, 0), 2, 16, 8).is_err());
    }
}
