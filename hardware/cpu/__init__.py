"""CPU adapter and the torch-native SGLang out-of-tree platform."""
