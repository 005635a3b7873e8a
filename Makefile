# Makefile — the front door. Site settings are in Makefile.inc.
#   make          build ptrain (installs missing Debian packages first, as root)
#   make run      train on the default deck ($(DECK)) with $(NP) rank(s)
#   make test     build and run the whole test suite (ctest)
#   make test-quick   only the tests labelled quick
#   make install  install to $(PREFIX), with the Lmod modulefile
include Makefile.inc

# A Debian path (the MPI flavour's wrappers and launcher) on Debian, nothing elsewhere. It does
# not ask whether the file exists: on a fresh machine `make deps` installs it first.
debian_path = $(if $(wildcard /etc/debian_version),$(1))
# A configured build folder keeps its MPI flavour: without MPI on the command line (or in the
# environment), make there uses the folder's, e.g. `make install BUILD_DIR=build-mpich`.
ifeq ($(origin MPI),file)
  MPI_OF_BUILD_DIR := $(shell sed -n 's/^PTRAIN_MPI:[A-Z]*=//p' $(BUILD_DIR)/CMakeCache.txt 2>/dev/null)
  ifneq ($(MPI_OF_BUILD_DIR),)
    MPI := $(MPI_OF_BUILD_DIR)
  endif
endif
ifeq ($(filter $(MPI),openmpi mpich),)
  $(error Makefile.inc: MPI = $(MPI); use openmpi or mpich)
endif

# The CUDA backend: every file that includes Kokkos goes through the CUDA Kokkos' nvcc_wrapper.
ifeq ($(ENABLE_CUDA),ON)
  ifeq ($(KOKKOS_ROOT),)
    $(error ENABLE_CUDA=ON needs KOKKOS_ROOT, a Kokkos built with CUDA (its bin/nvcc_wrapper compiles ptrain))
  endif
  ifeq ($(origin CXX),default)
    CXX := $(KOKKOS_ROOT)/bin/nvcc_wrapper
  endif
  export PATH := $(CUDA_HOME)/bin:$(PATH)
  CUDA_ARGS = -DCMAKE_CXX_FLAGS=-arch=sm_$(CUDA_ARCH) \
              -DCUDAToolkit_ROOT=$(CUDA_HOME)
endif

CMAKE_ARGS = -S . -B $(BUILD_DIR) $(CUDA_ARGS) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
  -DCMAKE_CXX_COMPILER=$(CXX) -DCMAKE_C_COMPILER=$(CC) -DCMAKE_INSTALL_PREFIX=$(PREFIX) \
  -DPTRAIN_ENABLE_CUDA=$(ENABLE_CUDA) -DCMAKE_CUDA_ARCHITECTURES=$(CUDA_ARCH) \
  -DPTRAIN_WERROR=$(WERROR) -DPTRAIN_DEVICE_GUARD=$(DEVICE_GUARD) -DPTRAIN_ARCH_FLAGS="$(ARCH_FLAGS)" -DPTRAIN_MPI=$(MPI) \
  $(if $(MPI_CC),-DMPI_C_COMPILER=$(MPI_CC)) $(if $(MPI_CXX),-DMPI_CXX_COMPILER=$(MPI_CXX)) \
  $(if $(MPIEXEC),-DMPIEXEC_EXECUTABLE=$(MPIEXEC)) \
  $(if $(HDF5_CC),-DHDF5_C_COMPILER_EXECUTABLE=$(HDF5_CC)) \
  $(if $(KOKKOS_ROOT),-DKokkos_ROOT=$(KOKKOS_ROOT)) \
  $(if $(HDF5_ROOT),-DHDF5_ROOT=$(HDF5_ROOT)) \
  $(if $(BLAS_ROOT),-DCMAKE_PREFIX_PATH=$(BLAS_ROOT))

.PHONY: all deps configure build run test test-quick install clean

all: build

# Install what is missing (root on Debian), or say exactly what to install and stop.
deps:
	@missing=""; \
	if command -v dpkg-query >/dev/null 2>&1; then \
	  for p in $(DEBIAN_PACKAGES); do \
	    dpkg-query -W -f='$${db:Status-Status}' $$p 2>/dev/null | grep -q '^installed$$' || missing="$$missing $$p"; \
	  done; \
	  if [ -n "$$missing" ]; then \
	    if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	      echo "make deps: installing$$missing"; \
	      export DEBIAN_FRONTEND=noninteractive; \
	      apt-get update -q && apt-get install -y -q --no-install-recommends $$missing || exit 1; \
	    else \
	      echo "make deps: missing Debian packages. Install them with:"; \
	      echo "  sudo apt-get install --no-install-recommends$$missing"; exit 1; \
	    fi; \
	  fi; \
	else \
	  for t in cmake mpicxx h5pcc; do command -v $$t >/dev/null 2>&1 || missing="$$missing $$t"; done; \
	  if [ -n "$$missing" ]; then \
	    echo "make deps: not a Debian system and missing:$$missing"; \
	    echo "  needs: CMake >= 3.20, a C++17 compiler, MPI >= 3.1, parallel HDF5, Kokkos 3.4/4.x,"; \
	    echo "  CBLAS (OpenBLAS), GoogleTest; set their roots in Makefile.inc"; exit 1; \
	  fi; \
	fi

# A build folder keeps the MPI flavour it was configured with: asking for the other one there
# is an error, not a silent mix of two MPIs. The switches below, given on make's command line,
# reach a folder already configured (`make build WERROR=ON` there turns warnings into errors).
RECONFIGURE_ARGS = $(foreach v,WERROR DEVICE_GUARD,$(if $(filter command line,$(origin $(v))),-DPTRAIN_$(v)=$($(v)))) \
  $(if $(filter command line,$(origin BUILD_TYPE)),-DCMAKE_BUILD_TYPE=$(BUILD_TYPE))
configure: deps
	@if [ -f $(BUILD_DIR)/CMakeCache.txt ]; then \
	  was=$$(sed -n 's/^PTRAIN_MPI:[A-Z]*=//p' $(BUILD_DIR)/CMakeCache.txt); \
	  if [ -n "$$was" ] && [ "$$was" != "$(MPI)" ]; then \
	    echo "make: $(BUILD_DIR) is configured for MPI=$$was, not MPI=$(MPI):" \
	         "use another folder (e.g. BUILD_DIR=build-$(MPI)) or make clean"; exit 1; \
	  fi; \
	  if [ -n "$(RECONFIGURE_ARGS)" ]; then cmake -B $(BUILD_DIR) $(RECONFIGURE_ARGS); fi; \
	else cmake $(CMAKE_ARGS); fi

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

# The launcher and the flags it needs here (mpiexec.env, written by CMake), then the site's.
run: build
	. $(BUILD_DIR)/mpiexec.env && $$MPIEXEC $$MPIEXEC_PREFLAGS $(MPIEXEC_FLAGS) -np $(NP) \
	  $(BUILD_DIR)/ptrain $(DECK)

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure

test-quick: build
	cd $(BUILD_DIR) && ctest --output-on-failure -L quick

install: build
	cmake --install $(BUILD_DIR) --prefix $(PREFIX)
	@v=$$($(BUILD_DIR)/ptrain --version | awk '{print $$2}'); \
	 mkdir -p $(PREFIX)/share/modulefiles/ptrain; \
	 sed -e "s|@VERSION@|$$v|g" -e "s|@PREFIX@|$(PREFIX)|g" -e "s|@MODULE_DEPS@|$(MODULE_DEPS)|g" \
	   modules/ptrain/ptrain.lua.in \
	   > $(PREFIX)/share/modulefiles/ptrain/$$v.lua; \
	 echo "installed modulefile $(PREFIX)/share/modulefiles/ptrain/$$v.lua"

clean:
	rm -rf $(BUILD_DIR)
