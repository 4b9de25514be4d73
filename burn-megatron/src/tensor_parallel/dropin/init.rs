//! Burn's initialisers as master initialisers: drawn on the host from a seed, the same full
//! tensor at every TP size.

use super::super::{MasterInit, TpError};
use burn::nn::Initializer;

/// The [`MasterInit`] that draws what Burn's `initializer` draws (the same law, not the same
/// values: Burn draws from its device generator), or an error naming it when there is none:
/// `KaimingUniform` with gain `1/√3` (Burn's default for `Linear`, PyTorch's `nn.Linear`),
/// `Normal`, `Uniform`, `Constant`, `Zeros`, `Ones`.
///
/// ```
/// use burn::nn::Initializer;
/// use burn_megatron::tensor_parallel::{MasterInit, dropin::master_init};
/// let burn = Initializer::KaimingUniform { gain: 1.0 / 3f64.sqrt(), fan_out_only: false };
/// assert_eq!(master_init(&burn).unwrap(), MasterInit::KaimingUniform);
/// assert!(master_init(&Initializer::XavierNormal { gain: 1.0 }).is_err());
/// ```
pub fn master_init(initializer: &Initializer) -> Result<MasterInit, TpError> {
    let init = match *initializer {
        Initializer::KaimingUniform {
            gain,
            fan_out_only: false,
        } if (gain - 1.0 / 3f64.sqrt()).abs() < 1e-12 => MasterInit::KaimingUniform,
        Initializer::Normal { mean, std } => MasterInit::Normal { mean, std },
        Initializer::Uniform { min, max } => MasterInit::Uniform {
            low: min,
            high: max,
        },
        Initializer::Constant { value } => MasterInit::Constant(value),
        Initializer::Zeros => MasterInit::ZEROS,
        Initializer::Ones => MasterInit::Constant(1.0),
        ref other => {
            return Err(TpError::Invalid(format!(
                "{other:?} has no master initialiser here (KaimingUniform with gain 1/√3, \
                 Normal, Uniform, Constant, Zeros and Ones do)"
            )));
        }
    };
    init.check()?;
    Ok(init)
}
