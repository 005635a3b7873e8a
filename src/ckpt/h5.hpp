// ckpt/h5.hpp — internal to the ckpt module: RAII for HDF5 handles, HDF5's own error
// text in our messages, and a scope that keeps HDF5 from printing its error stack.
#pragma once
#include <hdf5.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <utility>

#include "util/error.hpp"

namespace ptrain::ckpt::h5 {

// Silences HDF5's automatic error printing while alive (we report errors ourselves).
class QuietErrors {
 public:
  QuietErrors() {
    H5Eget_auto2(H5E_DEFAULT, &func_, &data_);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  }
  ~QuietErrors() { H5Eset_auto2(H5E_DEFAULT, func_, data_); }
  QuietErrors(const QuietErrors&) = delete;
  QuietErrors& operator=(const QuietErrors&) = delete;

 private:
  H5E_auto2_t func_ = nullptr;
  void* data_ = nullptr;
};

// Text read from a file (a link or attribute name, an attribute's value, a `latest` pointer) or
// given by HDF5, fit for a one-line message: bytes other than printable ASCII written as \xNN,
// and cut to `length` characters of that.
inline std::string printable(const std::string& text, std::size_t length = 200) {
  std::string out;
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    char piece[8] = {static_cast<char>(c), 0};
    if (c < 0x20 || c >= 0x7f) std::snprintf(piece, sizeof piece, "\\x%02x", unsigned(c));
    if (out.size() + std::strlen(piece) > length) return out + "...";
    out += piece;
  }
  return out;
}

// The most specific message on HDF5's current error stack ("truncated file: eof = ...").
inline std::string last_error() {
  std::string text;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned n, const H5E_error2_t* e, void* out) -> herr_t {
        if (n == 0 && e->desc) *static_cast<std::string*>(out) = e->desc;
        return 0;
      },
      &text);
  H5Eclear2(H5E_DEFAULT);
  return text.empty() ? std::string("unknown HDF5 error") : printable(text);
}

// One HDF5 identifier, closed with its own close function when the owner dies.
class Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  Handle() = default;
  Handle(hid_t id, Closer closer) : id_(id), close_(closer) {}
  Handle(Handle&& o) noexcept { swap(o); }
  Handle& operator=(Handle&& o) noexcept {
    Handle tmp(std::move(o));
    swap(tmp);
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() {
    if (id_ >= 0 && close_) close_(id_);
  }
  hid_t get() const { return id_; }
  explicit operator bool() const { return id_ >= 0; }
  // Closes now and throws when that fails (a file's close flushes what was written).
  void close(const std::string& what) {
    const hid_t id = std::exchange(id_, -1);
    if (id >= 0 && close_ && close_(id) < 0) throw Error(cat(what, ": close: ", last_error()));
  }

 private:
  void swap(Handle& o) noexcept {
    std::swap(id_, o.id_);
    std::swap(close_, o.close_);
  }
  hid_t id_ = -1;
  Closer close_ = nullptr;
};

// Wraps a freshly returned identifier; a negative one throws "<what>: <HDF5's reason>".
inline Handle checked(hid_t id, Handle::Closer closer, const std::string& what) {
  if (id < 0) throw Error(cat(what, ": ", last_error()));
  return Handle(id, closer);
}
inline void check(herr_t status, const std::string& what) {
  if (status < 0) throw Error(cat(what, ": ", last_error()));
}

inline Handle file(hid_t id, const std::string& what) { return checked(id, H5Fclose, what); }
inline Handle group(hid_t id, const std::string& what) { return checked(id, H5Gclose, what); }
inline Handle dataset(hid_t id, const std::string& what) { return checked(id, H5Dclose, what); }
inline Handle space(hid_t id, const std::string& what) { return checked(id, H5Sclose, what); }
inline Handle type(hid_t id, const std::string& what) { return checked(id, H5Tclose, what); }
inline Handle attribute(hid_t id, const std::string& what) { return checked(id, H5Aclose, what); }
inline Handle plist(hid_t id, const std::string& what) { return checked(id, H5Pclose, what); }

}  // namespace ptrain::ckpt::h5
