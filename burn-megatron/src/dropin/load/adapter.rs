//! Burn-store's `PyTorchToBurnAdapter`, as `LoadOptions::with_pytorch_adapter` reads a state
//! dict: which layer holds each parameter, and the name a PyTorch norm gives its own.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use std::collections::HashMap;

/// The path under which a PyTorch state dict stores the norm parameter at `path` (`weight`
/// for `gamma`, `bias` for `beta`), when its layer `owner` is one of Burn's norms.
pub(in crate::dropin) fn pytorch_norm_key(owner: Option<&str>, path: &str) -> Option<String> {
    const NORMS: [&str; 4] = [
        "Struct:LayerNorm",
        "Struct:RmsNorm",
        "Struct:BatchNorm",
        "Struct:GroupNorm",
    ];
    owner.filter(|o| NORMS.contains(o))?;
    let (layer, field) = path.rsplit_once('.').unwrap_or(("", path));
    let torch = match field {
        "gamma" => "weight",
        "beta" => "bias",
        _ => return None,
    };
    Some(match layer {
        "" => torch.to_string(),
        _ => format!("{layer}.{torch}"),
    })
}

/// The type of the layer holding each float parameter (`Struct:Linear`: Burn's derive
/// passes the owning struct's name as it enters each field), by parameter path.
pub(in crate::dropin) fn owners<M: Module>(model: &M) -> HashMap<String, String> {
    struct Owners(Vec<(String, String)>, HashMap<String, String>);
    impl ModuleVisitor for Owners {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            self.0.push((name.to_string(), container_type.to_string()));
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, _: &Param<Tensor<D>>) {
            let path: Vec<&str> = self.0.iter().map(|(n, _)| n.as_str()).collect();
            let owner = self
                .0
                .iter()
                .rev()
                .map(|(_, t)| t.as_str())
                .find(|t| t.starts_with("Struct:") || t.starts_with("Enum:"));
            if let Some(owner) = owner {
                self.1.insert(path.join("."), owner.to_string());
            }
        }
    }
    let mut owners = Owners(Vec::new(), HashMap::new());
    model.visit(&mut owners);
    owners.1
}
