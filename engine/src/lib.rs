pub use llama_cpp_2;
