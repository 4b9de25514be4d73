//! Burn's initialisers as master initialisers: drawn on the host from a seed, the same full
//! tensor at every TP size.

use crate::tensor_parallel::{MasterInit, TpError};
use burn::nn::Initializer;

/// The [`MasterInit`] that draws what Burn's `initializer` draws for a parameter Burn gives
/// `fan_in` and `fan_out` (a linear layer's input and output widths; an embedding has
/// neither): the same law, not the same values, as Burn draws from its device generator.
/// Every initializer but `Orthogonal` (which orthogonalises the whole matrix) has one; a
/// Kaiming or Xavier law without the fan it needs is an error naming it, where Burn panics.
///
/// ```
/// use burn::nn::Initializer;
/// use burn_megatron::dropin::master_init;
/// use burn_megatron::tensor_parallel::MasterInit;
/// // Burn's default for a Linear, PyTorch's nn.Linear: uniform on ±1/√fan_in.
/// let burn = Initializer::KaimingUniform { gain: 1.0 / 3f64.sqrt(), fan_out_only: false };
/// assert_eq!(master_init(&burn, Some(64), Some(32)).unwrap(), MasterInit::KaimingUniform);
/// // Xavier's over widths 4 and 2: uniform on ±√(6 / 6).
/// let xavier = master_init(&Initializer::XavierUniform { gain: 1.0 }, Some(4), Some(2));
/// let MasterInit::Uniform { low, high } = xavier.unwrap() else { panic!() };
/// assert!((high - 1.0).abs() < 1e-12 && low == -high);
/// assert!(master_init(&Initializer::XavierNormal { gain: 1.0 }, None, None).is_err());
/// assert!(master_init(&Initializer::Orthogonal { gain: 1.0 }, Some(4), Some(4)).is_err());
/// ```
pub fn master_init(
    initializer: &Initializer,
    fan_in: Option<usize>,
    fan_out: Option<usize>,
) -> Result<MasterInit, TpError> {
    let fan = |fan: Option<usize>, which: &str| {
        fan.filter(|&f| f > 0).ok_or_else(|| {
            TpError::Invalid(format!(
                "{initializer:?} needs the parameter's {which}, which Burn does not give it"
            ))
        })
    };
    let kaiming_std = |gain: f64, fan_out_only: bool| -> Result<f64, TpError> {
        let f = match fan_out_only {
            true => fan(fan_out, "fan-out")?,
            false => fan(fan_in, "fan-in")?,
        };
        Ok(gain / (f as f64).sqrt())
    };
    let xavier_std = |gain: f64| -> Result<f64, TpError> {
        let fans = fan(fan_in, "fan-in")? + fan(fan_out, "fan-out")?;
        Ok(gain * (2.0 / fans as f64).sqrt())
    };
    let symmetric = |a: f64| MasterInit::Uniform { low: -a, high: a };
    let centred = |std: f64| MasterInit::Normal { mean: 0.0, std };
    let init = match *initializer {
        // PyTorch's `nn.Linear` law, drawn as the built-in models draw it.
        Initializer::KaimingUniform {
            gain,
            fan_out_only: false,
        } if (gain - 1.0 / 3f64.sqrt()).abs() < 1e-12 => {
            fan(fan_in, "fan-in")?;
            MasterInit::KaimingUniform
        }
        Initializer::KaimingUniform { gain, fan_out_only } => {
            symmetric(3f64.sqrt() * kaiming_std(gain, fan_out_only)?)
        }
        Initializer::KaimingNormal { gain, fan_out_only } => {
            centred(kaiming_std(gain, fan_out_only)?)
        }
        Initializer::XavierUniform { gain } => symmetric(3f64.sqrt() * xavier_std(gain)?),
        Initializer::XavierNormal { gain } => centred(xavier_std(gain)?),
        Initializer::Normal { mean, std } => MasterInit::Normal { mean, std },
        Initializer::Uniform { min, max } => MasterInit::Uniform {
            low: min,
            high: max,
        },
        Initializer::Constant { value } => MasterInit::Constant(value),
        Initializer::Zeros => MasterInit::ZEROS,
        Initializer::Ones => MasterInit::Constant(1.0),
        Initializer::Orthogonal { .. } => {
            return Err(TpError::Invalid(format!(
                "{initializer:?} has no master initialiser here: it orthogonalises the whole \
                 matrix, which no rank holds (load the weights from a record instead)"
            )));
        }
    };
    init.check()?;
    Ok(init)
}
