//! The distributed optimizer (ZeRO-1) around a burn-optim optimizer: this data-parallel
//! rank's pieces of the trainable parameters (from its [`ShardPlan`]s) are the 1-D FP32
//! parameters of a module of their own, which the burn-optim optimizer steps. Adam's update
//! is element-wise, so stepping a piece is stepping those elements of the whole parameter.

use super::cast::to_model_dtype;
use super::error::OptimizerError;
use super::fused_adam::{Place, Replace, Sharding, check_covers_experts, gather_pieces};
use super::grad_norm::{NormType, clip_coefficient, largest_magnitude};
use crate::comm::CommError;
use crate::param_grads::with_flat;
use crate::tensor_parallel::parallel_attrs;
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, ModuleOptimizer, OptimizerRecord};
use burn::tensor::{Bytes, DType, Tensor, TensorData};
use burn_megatron_kernels::device::ReadBack;
use burn_megatron_kernels::multi_tensor_sum_of_squares;
use std::collections::HashMap;

/// One piece of a parameter: elements `[start, start + len)` of its flattened value.
#[derive(Debug, Clone)]
struct Piece {
    param: ParamId,
    rank: usize,
    start: usize,
    len: usize,
    dtype: DType,
    place: Place,
}

/// This rank's FP32 master pieces, as parameters a burn-optim optimizer can step.
#[derive(Module, Debug)]
pub(crate) struct Pieces {
    parts: Vec<Param<Tensor<1>>>,
}

/// What one step measured before the reduction: flags and norm parts.
pub(crate) struct Measured {
    grads: Vec<Tensor<1>>,
    pub(crate) non_finite: bool,
    /// Over the dense parameters' pieces.
    pub(crate) norm_part: f64,
    /// Over the experts' pieces.
    pub(crate) expert_norm_part: f64,
}

pub(crate) struct ShardedBurn {
    inner: ModuleOptimizer,
    pieces: Vec<Piece>,
    master: Option<Pieces>,
    pub(crate) sharding: Sharding,
}

impl ShardedBurn {
    pub(crate) fn new<M: Module>(
        inner: ModuleOptimizer,
        model: &M,
        shards: Sharding,
    ) -> Result<Self, CommError> {
        shards.check("distributed optimizer")?;
        check_covers_experts(model, &shards)?;
        let values = flat_values(model);
        let mut pieces = Vec::new();
        let mut parts = Vec::new();
        for (plan, (shard, _)) in shards.plans().enumerate() {
            for p in shard.pieces() {
                let Some(v) = values.get(&p.id) else { continue };
                let part = v.clone().cast(DType::F32).narrow(0, p.start, p.len);
                parts.push(Param::from_tensor(part.detach().require_grad()));
                pieces.push(Piece {
                    param: p.id,
                    rank: p.rank,
                    start: p.start,
                    len: p.len,
                    dtype: v.dtype(),
                    place: Place {
                        plan,
                        bucket: p.bucket,
                        at: p.at,
                    },
                });
            }
        }
        Ok(Self {
            inner,
            pieces,
            master: Some(Pieces { parts }),
            sharding: shards,
        })
    }

    /// Elements of FP32 master weights this rank holds.
    pub(crate) fn state_elements(&self) -> usize {
        self.pieces.iter().map(|p| p.len).sum()
    }

    /// This rank's unscaled gradient pieces, with their overflow flag and the dense and the
    /// experts' norm parts (pieces of duplicated parameters counted on TP rank 0 only, as
    /// without sharding).
    pub(crate) fn measure(
        &self,
        grads: &GradientsParams,
        tp_rank: usize,
        norm_type: NormType,
        inv_scale: f64,
    ) -> Measured {
        let grads: Vec<Tensor<1>> = self
            .pieces
            .iter()
            .zip(&self.master.as_ref().expect("between steps").parts)
            .map(|(p, part)| {
                let g = with_flat(grads, p.param, p.rank, |g| g.cast(DType::F32))
                    .map(|g| g.narrow(0, p.start, p.len))
                    .unwrap_or_else(|| part.val().inner().zeros_like());
                if inv_scale == 1.0 { g } else { g * inv_scale }
            })
            .collect();
        // One sum-of-squares pass over every piece and one read give both the overflow
        // check (any piece may hold inf or NaN) and, under L2, the norm parts: as without
        // sharding, and without a read per piece.
        let sums: Vec<f32> = match grads.iter().any(|g| g.dims()[0] > 0) {
            true => multi_tensor_sum_of_squares(&grads)
                .expect("the gradients of one module share a device")
                .read_back()
                .iter::<f32>()
                .collect(),
            false => vec![0.0; grads.len()],
        };
        let non_finite = sums.iter().any(|s| !s.is_finite());
        let part = |experts: bool| {
            let counted = self
                .pieces
                .iter()
                .zip(grads.iter().zip(&sums))
                .filter(|(p, _)| {
                    let attrs = parallel_attrs(p.param);
                    attrs.expert == experts && attrs.counts_in_grad_norm(tp_rank)
                });
            match norm_type {
                NormType::L2 => counted.map(|(_, (_, &s))| f64::from(s)).sum(),
                NormType::Inf => largest_magnitude(counted.map(|(_, (g, _))| g)),
            }
        };
        Measured {
            non_finite,
            norm_part: part(false),
            expert_norm_part: part(true),
            grads,
        }
    }

    /// Clips the measured pieces, decays the master pieces of weight-decayed parameters
    /// (`factor`, Megatron's no-decay group being the 1-D ones), steps them, and returns
    /// `model` with the all-gathered weights.
    pub(crate) fn apply<M: Module>(
        &mut self,
        measured: Measured,
        lr: f64,
        clip: f64,
        norm: f64,
        decay: Option<f64>,
        model: M,
    ) -> Result<(M, f64), OptimizerError> {
        let coeff = clip_coefficient(clip, norm);
        let master = self.master.take().expect("between steps");
        let mut grads = GradientsParams::new();
        let parts: Vec<Param<Tensor<1>>> = master
            .parts
            .into_iter()
            .zip(measured.grads)
            .zip(&self.pieces)
            .map(|((part, g), piece)| {
                let g = if coeff == 1.0 { g } else { g * coeff };
                grads.register(part.id, g);
                match decay.filter(|_| piece.rank > 1) {
                    Some(f) => part.map(|t| t.mul_scalar(f).detach().require_grad()),
                    None => part,
                }
            })
            .collect();
        let stepped = self.inner.step(lr, Pieces { parts }, grads);
        let placed: Vec<(Place, Tensor<1>)> = self
            .pieces
            .iter()
            .zip(&stepped.parts)
            .map(|(p, part)| (p.place, to_model_dtype(part.val().detach(), p.dtype)))
            .collect();
        self.master = Some(stepped);
        let device = self.device();
        let values = gather_pieces(&self.sharding, &device, placed, |d| d)?;
        Ok((model.map(&mut Replace(values)), coeff))
    }

    fn device(&self) -> burn::tensor::Device {
        self.master
            .as_ref()
            .and_then(|m| m.parts.first())
            .map_or_else(burn::tensor::Device::flex, |p| p.val().device())
    }

    /// The shards and their groups.
    pub(crate) fn shards(&self) -> &Sharding {
        &self.sharding
    }
}

/// Each float parameter's flattened value (no autodiff), by id.
fn flat_values<M: Module>(model: &M) -> HashMap<ParamId, Tensor<1>> {
    struct Values(HashMap<ParamId, Tensor<1>>);
    impl ModuleVisitor for Values {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if p.val().is_require_grad() {
                self.0.insert(p.id, p.val().detach().reshape([-1]));
            }
        }
    }
    let mut v = Values(HashMap::new());
    model.visit(&mut v);
    v.0
}

/// A burn-pack record's tensors `"{id}.{field}"` by id and its scalars `"{id}.{key}"` by id.
type Parsed = (
    HashMap<u64, Vec<(String, TensorData)>>,
    HashMap<u64, Vec<(String, burn_pack::Scalar)>>,
);

fn parse(record: OptimizerRecord) -> Result<Parsed, String> {
    let bytes = record.into_bytes().map_err(|e| format!("{e:?}"))?;
    let reader = burn_pack::Reader::from_bytes(bytes).map_err(|e| format!("{e:?}"))?;
    let mut scalars: HashMap<u64, Vec<(String, burn_pack::Scalar)>> = HashMap::new();
    for (key, value) in reader.scalars() {
        if let Some((id, k)) = key.split_once('.')
            && let Ok(id) = id.parse()
        {
            scalars.entry(id).or_default().push((k.to_string(), *value));
        }
    }
    let mut tensors: HashMap<u64, Vec<(String, TensorData)>> = HashMap::new();
    for t in reader.into_tensors().map_err(|e| format!("{e:?}"))? {
        let (name, dtype, shape, param_id, bytes) = t.into_parts().map_err(|e| format!("{e:?}"))?;
        if let (Some(id), Some((_, field))) = (param_id, name.split_once('.')) {
            let data = TensorData::from_bytes(bytes, shape.to_vec(), dtype);
            tensors
                .entry(id)
                .or_default()
                .push((field.to_string(), data));
        }
    }
    for v in tensors.values_mut() {
        v.sort_by(|a, b| a.0.cmp(&b.0));
    }
    Ok((tensors, scalars))
}

/// A record of `tensors` (id, field, data) and `scalars` (id, key, value).
fn build(
    tensors: Vec<(u64, String, TensorData)>,
    scalars: Vec<(u64, String, burn_pack::Scalar)>,
) -> Result<OptimizerRecord, String> {
    let packed = tensors
        .into_iter()
        .map(|(id, field, data)| {
            let shape = data.shape().to_vec();
            let dtype = data.dtype();
            let bytes = Bytes::from_bytes_vec(data.as_bytes().to_vec());
            burn_pack::Tensor::new(format!("{id}.{field}"), dtype, shape, Some(id), bytes)
        })
        .collect();
    let mut writer = burn_pack::Writer::new(packed);
    for (id, key, value) in scalars {
        writer = writer.with_scalar(&format!("{id}.{key}"), value);
    }
    let bytes = writer.into_bytes().map_err(|e| format!("{e:?}"))?;
    OptimizerRecord::from_bytes(bytes).map_err(|e| format!("{e:?}"))
}

/// The key of a record's tensor-rank scalar, which pieces (1-D) and parameters differ in.
const RANK_KEY: &str = "__rank";

impl ShardedBurn {
    fn invalid(&self, reason: String) -> OptimizerError {
        OptimizerError::Comm(CommError::InvalidArgument {
            group: self.sharding.dp().group().to_string(),
            op: "distributed optimizer state",
            reason,
        })
    }

    /// The state as a record over `model`'s whole parameters, and the FP32 master weights as
    /// `model` in f32: every rank's pieces all-gathered, so that a checkpoint holds what the
    /// unsharded optimizer would. Collective over the data-parallel group.
    pub(crate) fn whole<M: Module + Clone>(
        &self,
        model: &M,
    ) -> Result<(OptimizerRecord, M), OptimizerError> {
        let (size, plans) = (self.sharding.dp().group().size(), self.sharding.dense());
        // Every rank must hold a piece to know the state's fields; they can all tell. (A dense
        // piece on every data-parallel rank is one on every rank.)
        if let Some(r) =
            (0..size).find(|&r| plans.iter().all(|p| p.for_rank(r).pieces().is_empty()))
        {
            return Err(self.invalid(format!(
                "data-parallel rank {r} holds no element of the model: too small to shard"
            )));
        }
        let master = self.master.as_ref().expect("between steps");
        let (mut tensors, scalars) = parse(self.inner.to_record()).map_err(|e| self.invalid(e))?;
        let first = master.parts.first().map(|p| p.id.val());
        let fields: Vec<String> = first
            .and_then(|id| tensors.get(&id))
            .map(|v| v.iter().map(|(f, _)| f.clone()).collect())
            .unwrap_or_default();
        let device = self.device();
        let mut whole = Vec::new();
        for field in &fields {
            let placed = self
                .pieces
                .iter()
                .zip(&master.parts)
                .map(|(p, part)| {
                    let data = tensors
                        .get_mut(&part.id.val())
                        .and_then(|v| {
                            v.iter()
                                .position(|(f, _)| f == field)
                                .map(|i| v.swap_remove(i).1)
                        })
                        .ok_or_else(|| {
                            self.invalid(format!("piece of {:?} without {field}", p.param))
                        })?;
                    Ok((p.place, Tensor::<1>::from_data(data, &device)))
                })
                .collect::<Result<Vec<_>, OptimizerError>>()?;
            for (id, t) in gather_pieces(&self.sharding, &device, placed, |_| DType::F32)? {
                whole.push((id, field.clone(), t));
            }
        }
        let shapes = trainable_dims(model);
        let record_tensors = whole
            .into_iter()
            .map(|(id, field, t)| {
                let data = t.into_data();
                let shape = shapes
                    .get(&id)
                    .cloned()
                    .unwrap_or_else(|| data.shape().to_vec());
                (
                    id.val(),
                    field,
                    TensorData::from_bytes_vec(data.as_bytes().to_vec(), shape, data.dtype()),
                )
            })
            .collect();
        // Every piece has stepped as often as the others: the first one's counters stand for
        // every parameter's.
        let template: Vec<(String, burn_pack::Scalar)> = first
            .and_then(|id| scalars.get(&id).cloned())
            .unwrap_or_default()
            .into_iter()
            .filter(|(k, _)| k != RANK_KEY)
            .collect();
        let mut record_scalars = Vec::new();
        for (id, dims) in &shapes {
            for (k, v) in &template {
                record_scalars.push((id.val(), k.clone(), *v));
            }
            let rank = burn_pack::Scalar::from(dims.len());
            record_scalars.push((id.val(), RANK_KEY.to_string(), rank));
        }
        let record = build(record_tensors, record_scalars).map_err(|e| self.invalid(e))?;
        let placed: Vec<(Place, Tensor<1>)> = self
            .pieces
            .iter()
            .zip(&master.parts)
            .map(|(p, part)| (p.place, part.val().detach()))
            .collect();
        let master_values = gather_pieces(&self.sharding, &device, placed, |_| DType::F32)?;
        let master_model =
            super::cast::cast_params(model.clone(), DType::F32).map(&mut Replace(master_values));
        Ok((record, master_model))
    }

    /// Takes the state of [`Self::whole`]'s form (a record over the model's parameters, the
    /// master weights as a model), keeping this rank's pieces.
    pub(crate) fn load_whole<M: Module>(
        &mut self,
        record: OptimizerRecord,
        master: &M,
    ) -> Result<(), OptimizerError> {
        let (tensors, scalars) = parse(record).map_err(|e| self.invalid(e))?;
        let masters = flat_values(master);
        let parts = self.master.take().expect("between steps").parts;
        let mut piece_tensors = Vec::new();
        let mut piece_scalars = Vec::new();
        let mut new_parts = Vec::new();
        for (p, part) in self.pieces.iter().zip(parts) {
            let pid = part.id.val();
            for (field, data) in tensors.get(&p.param.val()).into_iter().flatten() {
                let n = data.shape().iter().product::<usize>();
                let flat = TensorData::from_bytes_vec(data.as_bytes().to_vec(), [n], data.dtype());
                let flat = Tensor::<1>::from_data(flat, &part.val().device());
                piece_tensors.push((
                    pid,
                    field.clone(),
                    flat.narrow(0, p.start, p.len).into_data(),
                ));
            }
            for (k, v) in scalars.get(&p.param.val()).into_iter().flatten() {
                let v = if k == RANK_KEY {
                    burn_pack::Scalar::from(1usize)
                } else {
                    *v
                };
                piece_scalars.push((pid, k.clone(), v));
            }
            let value = masters
                .get(&p.param)
                .map(|m| m.clone().cast(DType::F32).narrow(0, p.start, p.len))
                .ok_or_else(|| self.invalid(format!("no master weights for {:?}", p.param)))?;
            new_parts.push(part.map(|_| value.detach().require_grad()));
        }
        let record = build(piece_tensors, piece_scalars).map_err(|e| self.invalid(e))?;
        // `load_record` takes the optimizer by value: a placeholder stands in meanwhile.
        let inner = std::mem::replace(&mut self.inner, burn::optim::AdamConfig::new().init());
        self.inner = inner.load_record(record);
        self.master = Some(Pieces { parts: new_parts });
        Ok(())
    }
}

/// The dims of every trained float parameter of `model`, by id.
fn trainable_dims<M: Module>(model: &M) -> HashMap<ParamId, Vec<usize>> {
    struct Dims(HashMap<ParamId, Vec<usize>>);
    impl ModuleVisitor for Dims {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let v = p.val();
            if v.is_require_grad() {
                self.0.insert(p.id, v.dims().to_vec());
            }
        }
    }
    let mut d = Dims(HashMap::new());
    model.visit(&mut d);
    d.0
}
